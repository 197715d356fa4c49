"""W10 quantized: a GPT-2-sized model (124M parameters) quantized with torchao's int8 weight-only,
saved and loaded (issue 26).

The model: a token embedding (50,257 x 768, float32, not quantized) and 12 blocks of four
``nn.Linear`` (768->2304, 768->768, 768->3072, 3072->768) quantized to ``Int8Tensor`` by
``quantize_(model, Int8WeightOnlyConfig())`` (built and quantized once, untimed). Comparisons:

* ``load_into_module`` (warm, cold): the saved tree filled into a live model quantized the same
  way (``memtree quantized``: inner tensor by inner tensor), against the same bytes as plain
  leaves filled into a module of plain buffers of the inner tensors' shapes and dtypes
  (``memtree plain, same bytes``): the issue's "GiB/s within 10% of a plain-tensor load of the
  same bytes". Each run's target tensors are compared with the model's, bit for bit.
* ``save``: ``memtree memmap`` (``TensorTree.from_module(model).memmap(d)``), ``torch.save``
  (``torch.save(model.state_dict(), f)``), ``torchao safetensors``
  (``flatten_tensor_state_dict`` + ``safetensors.torch.save_file``); each output read back and
  compared with the model's inner tensors.
* ``load, ready to run`` (warm, cold): the skeleton built untimed under ``memtree.empty_init()``,
  then timed: load, bind and the first forward (its output compared bit for bit with the
  original's): ``memtree load_into_module`` (the tree's tensors bound, mapped),
  ``torch.load(weights_only=True) + assign`` (``load_state_dict(..., assign=True)``),
  ``torchao safetensors + assign`` (``load_file`` + ``unflatten_tensor_state_dict``).

A library that is missing (torchao, safetensors) makes its rows ``N/A``; without torchao the
workload has no model to measure and every row is ``N/A``.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from checks import CheckFailed, digest
from harness import Comparison, System, remove, slug, wanted

ROWS_LOAD_INTO = ["memtree quantized", "memtree plain, same bytes"]
ROWS_SAVE = ["memtree memmap", "torch.save", "torchao safetensors"]
ROWS_READY = ["memtree load_into_module", "torch.load(weights_only=True) + assign", "torchao safetensors + assign"]


def _torchao() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # torchao mentions its optional CUDA kernels
        try:
            import torchao.quantization as q
            from torchao.prototype.safetensors import safetensors_support as ao_st
        except ImportError:
            return None
        finally:
            logging.disable(logging.NOTSET)
    return q, ao_st


def _sizes(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(vocabulary, width, blocks): GPT-2's, or tiny ones for ``--quick``."""
    return (512, 64, 2) if cfg["quick"] else (50257, 768, 12)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        width = h.shape[-1]
        h = h + self.proj(nn.functional.gelu(self.qkv(h)[..., :width]))
        return h + self.out(nn.functional.gelu(self.fc(h)))


class Net(nn.Module):
    def __init__(self, vocab: int, width: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.embed(tokens))


def describe(cfg: dict[str, Any]) -> str:
    vocab, width, blocks = _sizes(cfg)
    return f"a {vocab}x{width} embedding and {blocks} blocks of int8 weight-only linears (torchao)"


def _quantized(cfg: dict[str, Any], seed: int) -> nn.Module:
    q, _ = _torchao()
    torch.manual_seed(seed)
    model = Net(*_sizes(cfg)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q.quantize_(model, q.Int8WeightOnlyConfig())
    return model


def _inner(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every plain tensor of a module, a quantized weight as its inner tensors, by dotted name."""
    from memtree.format.subclass_registry import inner_tensors

    return {".".join((name, *path)): t for name, value in module.state_dict().items()
            for path, t in inner_tensors(value)}


def _expect(got: dict[str, torch.Tensor], want: dict[str, Any], what: str) -> None:
    bad = [k for k, d in want.items() if k not in got or digest(got[k]) != d]
    if bad or len(got) != len(want):
        raise CheckFailed(f"{what}: {len(bad)} tensors differ ({bad[:3]}), {len(got)} found, {len(want)} expected")


def comparisons(cfg: dict[str, Any]) -> Iterator[Comparison]:
    work = os.path.join(cfg["workdir"], "w10")
    os.makedirs(work, exist_ok=True)
    if _torchao() is None:
        missing = "N/A: torchao is not installed"
        for op, rows, caches in (("load_into_module", ROWS_LOAD_INTO, cfg["caches"]), ("save", ROWS_SAVE, [""]),
                                 ("load, ready to run", ROWS_READY, cfg["caches"])):
            for cache in caches:
                yield Comparison(op, cache, [System(n, run=lambda _: None, check=lambda s, o: None, missing=missing)
                                             for n in rows if wanted(n, cfg)])
        return
    import memtree

    model = _quantized(cfg, 0)
    want = {k: digest(t) for k, t in _inner(model).items()}
    tokens = torch.randint(0, _sizes(cfg)[0], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out_want = digest(model(tokens))
    tree_q = os.path.join(work, "quantized")
    memtree.TensorTree.from_module(model).memmap(tree_q)
    tree_p = os.path.join(work, "plain")
    memtree.TensorTree(_nested(_inner(model))).memmap(tree_p)
    for cache in cfg["caches"]:
        yield Comparison("load_into_module", cache, [
            s for s in (_fill(cfg, "memtree quantized", tree_q, want), _fill(cfg, "memtree plain, same bytes", tree_p, want))
            if wanted(s.name, cfg)
        ])
    yield Comparison("save", "", [_save(name, model, work, want) for name in ROWS_SAVE if wanted(name, cfg)])
    files = _files_for_ready(model, work)
    del model
    for cache in cfg["caches"]:
        yield Comparison("load, ready to run", cache, [
            _ready(name, cfg, files, tokens, out_want) for name in ROWS_READY if wanted(name, cfg)
        ])


def _nested(flat: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, t in flat.items():
        *parents, last = name.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = t
    return out


def _plain_module(nested: dict[str, Any]) -> nn.Module:
    """A module of plain buffers at the nested names (the same shapes and dtypes)."""
    m = nn.Module()
    for key, value in nested.items():
        if isinstance(value, dict):
            m.add_module(key, _plain_module(value))
        else:
            m.register_buffer(key, torch.empty_like(value))
    return m


def _fill(cfg: dict[str, Any], name: str, tree: str, want: dict[str, Any]) -> System:
    import memtree

    def setup() -> nn.Module:
        if name == "memtree quantized":
            return _quantized(cfg, 7)  # live, quantized the same way, other values
        return _plain_module(_nested(_inner(memtree.load_memmap(tree, device="meta"))))

    def check(target: nn.Module, _: Any) -> None:
        got = _inner(target) if name == "memtree quantized" else {
            k: v for k, v in target.state_dict().items()
        }
        _expect(got, want, f"{name}: the filled tensors")

    return System(name, run=lambda target: memtree.load_into_module(target, tree), check=check, setup=setup,
                  files=[tree])


def _save(name: str, model: nn.Module, work: str, want: dict[str, Any]) -> System:
    import memtree

    dst = os.path.join(work, "save_" + slug(name))
    _, ao_st = _torchao()

    def run(_: Any) -> None:
        if name == "memtree memmap":
            memtree.TensorTree.from_module(model).memmap(dst)
        elif name == "torch.save":
            torch.save(model.state_dict(), dst)
        else:
            from safetensors.torch import save_file

            data, meta = ao_st.flatten_tensor_state_dict(model.state_dict())
            save_file(data, dst, metadata=meta)

    def check(_: Any, __: Any) -> dict[str, float]:
        if name == "memtree memmap":
            got = _inner_of_state(memtree.load_memmap(dst).state_dict())
        elif name == "torch.save":
            got = _inner_of_state(torch.load(dst, weights_only=True))
        else:
            got = _inner_of_state(_torchao_state(dst))
        _expect(got, want, f"{name}: what was written")
        return {"bytes written": float(_disk(dst))}

    def setup() -> None:
        remove(dst)
        os.sync()

    missing = None
    if name == "torchao safetensors":
        try:
            import safetensors  # noqa: F401
        except ImportError:
            missing = "N/A: safetensors is not installed"
    return System(name, run=run, check=check, setup=setup, missing=missing, output=[dst])


def _disk(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _inner_of_state(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    from memtree.format.subclass_registry import inner_tensors

    return {".".join((k, *p)): t for k, v in state.items() if isinstance(v, torch.Tensor) for p, t in inner_tensors(v)}


def _torchao_state(path: str) -> dict[str, Any]:
    import json

    from safetensors.torch import load_file

    _, ao_st = _torchao()
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        meta = json.loads(f.read(n))["__metadata__"]
    state, _ = ao_st.unflatten_tensor_state_dict(load_file(path), meta)
    return state  # type: ignore[no-any-return]


def _files_for_ready(model: nn.Module, work: str) -> dict[str, str]:
    import memtree

    files = {"memtree": os.path.join(work, "ready_tree"), "torch": os.path.join(work, "ready.pt"),
             "torchao": os.path.join(work, "ready.safetensors")}
    memtree.TensorTree.from_module(model).memmap(files["memtree"])
    torch.save(model.state_dict(), files["torch"])
    try:
        from safetensors.torch import save_file

        data, meta = _torchao()[1].flatten_tensor_state_dict(model.state_dict())
        save_file(data, files["torchao"], metadata=meta)
    except ImportError:
        files.pop("torchao")
    return files


def _ready(name: str, cfg: dict[str, Any], files: dict[str, str], tokens: torch.Tensor, out_want: Any) -> System:
    import memtree

    def setup() -> nn.Module:
        with memtree.empty_init():
            return Net(*_sizes(cfg)).eval()

    def run(skeleton: nn.Module) -> torch.Tensor:
        if name == "memtree load_into_module":
            memtree.load_into_module(skeleton, files["memtree"])
        elif name.startswith("torch.load"):
            skeleton.load_state_dict(torch.load(files["torch"], weights_only=True), assign=True)
        else:
            skeleton.load_state_dict(_torchao_state(files["torchao"]), assign=True)
        with torch.no_grad():
            return skeleton(tokens)

    def check(_: Any, out: torch.Tensor) -> None:
        if digest(out) != out_want:
            raise CheckFailed(f"{name}: the first forward's output differs from the original model's")

    key = "memtree" if name.startswith("memtree") else "torch" if name.startswith("torch.load") else "torchao"
    missing = None if key in files else "N/A: safetensors is not installed"
    return System(name, run=run, check=check, setup=setup, files=[files.get(key, "")] if key in files else [],
                  missing=missing)
