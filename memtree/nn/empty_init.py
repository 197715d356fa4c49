"""Modules without allocated weights: :func:`empty_init`, then :func:`init_missing` for the rest.

Example:
    >>> from torch import nn
    >>> with empty_init():
    ...     m = nn.Linear(3, 2)
    >>> m.weight.device.type, init_missing(m), m.weight.device.type
    ('meta', ['weight', 'bias'], 'cpu')
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..errors import check_keywords
from ..tree.parts.bind import module_groups, names_list, set_slot

__all__ = ["INIT_FUNCTIONS", "empty_init", "init_missing"]


def _direct_tensors(m: nn.Module) -> Iterator[tuple[dict[str, Any], str, torch.Tensor]]:
    for store in (m._parameters, m._buffers):
        for attr, t in store.items():
            if t is not None:
                yield store, attr, t


def _fresh(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    new = torch.empty(t.shape, dtype=t.dtype, device=device)
    return nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new


@check_keywords
def init_missing(module: nn.Module, *, device: torch.device | str | None = None) -> list[str]:
    """Allocate and initialise every tensor of ``module`` still on the meta device.

    After :func:`empty_init` and a partial :func:`load_into_module` (a new head, a layer the
    checkpoint lacks), the tensors no source provided are still meta tensors and the module
    cannot run. This allocates each of them on ``device`` and initialises it with its
    sub-module's own ``reset_parameters()`` (or ``_reset_parameters()``), without touching that
    sub-module's loaded tensors. Tensors of a sub-module that has neither are zero-filled, with a
    warning naming them. Tied tensors stay tied.

    Args:
        module: the module to complete.
        device: where to allocate (default: the CPU).

    Returns:
        The dotted names that were initialised (``[]`` if nothing was on the meta device).

    Example:
        >>> from torch import nn
        >>> with empty_init():
        ...     m = nn.Linear(3, 2)
        >>> init_missing(m), m.weight.device.type
        (['weight', 'bias'], 'cpu')
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    fresh_ids: set[int] = set()
    owners: dict[int, nn.Module] = {}
    names: list[str] = []
    for group in module_groups(module, extra_state=False):
        if group.tensor.device.type != "meta":
            continue
        value = _fresh(group.tensor, dev)
        set_slot(group, value)
        fresh_ids.add(id(value))
        names.extend(group.names)
        for slot in group.slots:
            owners[id(slot.owner)] = slot.owner
    zeroed: list[str] = []
    with torch.no_grad():
        for m in owners.values():
            reset = getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)
            if not callable(reset):
                for _store, attr, t in _direct_tensors(m):
                    if id(t) in fresh_ids:
                        t.zero_()
                        zeroed.append(f"{type(m).__name__}.{attr}")
                continue
            # reset() initialises every tensor of the sub-module: hand it scratch tensors in place
            # of the ones that were loaded, then put those back.
            kept = [(store, attr, t) for store, attr, t in _direct_tensors(m) if id(t) not in fresh_ids]
            for store, attr, t in kept:
                store[attr] = _fresh(t, dev)
            try:
                reset()
            finally:
                for store, attr, t in kept:
                    store[attr] = t
    if zeroed:
        warnings.warn(
            "init_missing: these tensors' modules have no reset_parameters(); they were "
            f"zero-filled: {names_list(zeroed)}",
            stacklevel=2,
        )
    return names


#: The ``torch.nn.init`` functions that do nothing to a meta tensor inside :func:`empty_init`
#: (the list Hugging Face's ``no_init_weights`` patches). Running them on meta tensors would
#: compute nothing, yet the meta kernels of ``normal_``, ``trunc_normal_`` (and a few others)
#: import ``torch._dynamo`` on first use: about a second in a fresh process.
INIT_FUNCTIONS = (
    "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
    "sparse_",
)

_lock = threading.Lock()
_active_contexts = 0  # every thread's, under _lock: the patches stay while it is > 0
_patches: list[tuple[Any, str, Any, Any]] = []  # (owner, attribute, original, replacement)
_local = threading.local()  # .depth: this thread's open empty_init contexts


def _on() -> bool:
    return getattr(_local, "depth", 0) > 0


def _install() -> None:
    register_parameter = nn.Module.register_parameter
    register_buffer = nn.Module.register_buffer

    def meta_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register_parameter(self, name, param)
        if not _on():
            return
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta" and not isinstance(p, nn.parameter.UninitializedParameter):
            new = torch.Tensor._make_subclass(type(p), p.data.to("meta"), p.requires_grad)
            new.__dict__.update(p.__dict__)
            self._parameters[name] = new

    def meta_buffer(self: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        if (
            _on()
            and tensor is not None
            and persistent
            and not isinstance(tensor, nn.parameter.UninitializedBuffer)
        ):
            tensor = tensor.to("meta")
        register_buffer(self, name, tensor, persistent)

    def skip_on_meta(original: Any) -> Any:
        @functools.wraps(original)
        def init(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if _on() and isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
                return tensor
            return original(tensor, *args, **kwargs)

        return init

    _patches[:] = [
        (nn.Module, "register_parameter", register_parameter, meta_parameter),
        (nn.Module, "register_buffer", register_buffer, meta_buffer),
    ]
    for name in INIT_FUNCTIONS:
        original = getattr(nn.init, name, None)
        if original is not None:
            _patches.append((nn.init, name, original, skip_on_meta(original)))
    # transformers keeps its own table of the torch.nn.init functions, taken at import, and its
    # models' _init_weights call those: skip them too when transformers is already imported
    hf = sys.modules.get("transformers.initialization")
    table = getattr(hf, "TORCH_INIT_FUNCTIONS", None)
    if isinstance(table, dict):
        for name, original in list(table.items()):
            if name in INIT_FUNCTIONS and callable(original):
                _patches.append((table, name, original, skip_on_meta(original)))
    for owner, attr, _original, replacement in _patches:
        _set(owner, attr, replacement)


def _get(owner: Any, attr: str) -> Any:
    return owner.get(attr) if isinstance(owner, dict) else getattr(owner, attr, None)


def _set(owner: Any, attr: str, value: Any) -> None:
    if isinstance(owner, dict):
        owner[attr] = value
    else:
        setattr(owner, attr, value)


def _uninstall() -> None:
    for owner, attr, original, replacement in reversed(_patches):
        # put the original back unless someone patched over us meanwhile (then ours stays under
        # theirs and, outside any empty_init, only passes calls through)
        if _get(owner, attr) is replacement:
            _set(owner, attr, original)
    _patches.clear()


@contextmanager
def empty_init() -> Iterator[None]:
    """Build modules without allocating their weights: parameters go to the meta device.

    Inside the context, every parameter and every *persistent* buffer registered by a module
    constructor is moved to the meta device as soon as it is registered, and the
    ``torch.nn.init`` functions (:data:`INIT_FUNCTIONS`) return meta tensors untouched, so the
    constructor's own initialisation (``reset_parameters``) computes nothing (it would also
    import ``torch._dynamo`` on first use: a second in a fresh process). Bind real weights
    afterwards with ``load_memmap(d).to_module(model)`` or :func:`load_into_module`, and
    initialise what no checkpoint holds with :func:`init_missing`.

    *Non-persistent* buffers (``register_buffer(..., persistent=False)``: rotary frequencies,
    position ids, causal masks) are never in a checkpoint, so they are kept as the constructor
    computed them (on its device, usually the CPU): the model is runnable once the persistent
    tensors are bound. Non-persistent buffers are usually small; their memory is allocated.
    ``torch.nn.init`` functions applied to tensors that are not on the meta device still run.

    The context patches ``nn.Module.register_parameter``/``register_buffer`` and the
    ``torch.nn.init`` functions while any thread is inside one (like
    ``accelerate.init_empty_weights`` and Hugging Face's ``no_init_weights``; also the table of
    them that ``transformers`` models initialise with, if it is imported), but the patched
    functions only act in the threads that entered the context: a module built meanwhile in
    another thread is built normally. Contexts nest; leaving the outermost one (also by an
    exception) restores everything. Code that calls initialisers it imported before (``from
    torch.nn.init import normal_``) or tensor methods (``weight.normal_()``) still runs them, on
    meta tensors; a constructor that computes a weight eagerly before registering it (e.g.
    ``nn.Parameter(torch.randn(n, m))``) still pays for that one tensor, briefly.

    Example:
        >>> from torch import nn
        >>> with empty_init():
        ...     big = nn.Linear(100_000, 10_000)   # 4 GB of float32: allocates nothing
        >>> big.weight.device, big.weight.requires_grad
        (device(type='meta'), True)
    """
    global _active_contexts
    with _lock:
        if _active_contexts == 0:
            _install()
        _active_contexts += 1
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
        with _lock:
            _active_contexts -= 1
            if _active_contexts == 0:
                _uninstall()
