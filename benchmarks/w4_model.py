"""W4 model: time until a freshly built ~110M-parameter transformer is ready to run forward with
the saved weights, its peak RSS, and its first forward (compared with the original's output).

Rows (``ready`` = build the module + bind the weights; meta/empty-init modules allocate nothing):

* ``torch.load + load_state_dict``: an ordinary module (allocated, randomly initialised), then
  ``load_state_dict(torch.load(ckpt))``;
* ``torch.load(mmap) + assign``: a module built on the meta device, then
  ``load_state_dict(torch.load(ckpt, mmap=True), assign=True)``;
* ``safetensors + assign``: meta module, ``load_state_dict(load_file(f), assign=True)``;
* ``tensordict to_module``: meta module, ``TensorDict.load_memmap(d).to_module(model)``;
* ``tensorizer``: ``no_init_or_tensor`` module, ``TensorDeserializer(f).load_into_module``;
* ``memtree to_module``: module built under ``memtree.empty_init()``, then
  ``memtree.load_memmap(d).to_module(model)`` (N/A until memtree has them);
* ``raw mmap + assign`` (the limit): meta module, one raw file mapped, ``torch.frombuffer``
  views, ``load_state_dict(assign=True)``.

``ready, fresh process`` (rows in :data:`FRESH_ROWS`): the same ``ready`` in a new interpreter
(spawned; it imports torch, and transformers for ``model="gpt2"``, before the clock starts),
timing the row's library import + build + load + bind: what a process that starts, loads a
model and serves pays once (``benchmarks/floors.py w4-ready-fresh`` also runs it in forked
children of a process that imported every library: build + load + bind only). The first build of a module on the meta device runs its
initialisers there, and the meta kernel of ``normal_`` (``nn.Embedding``) imports
``torch._dynamo`` (about a second) unless something imported it before (``transformers``' GPT-2
module does).

``cfg["model"] = "gpt2"`` (``benchmarks/floors.py w4-ready-fresh``) builds ``transformers``'
``GPT2LMHeadModel(GPT2Config())`` (124M parameters, tied embeddings) instead of :class:`Model`;
only :data:`FRESH_ROWS` and the raw limit are prepared for it.
"""

from __future__ import annotations

import json
import mmap
import os
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from harness import Result, Settings, disk_usage, measure

HERE = os.path.dirname(os.path.abspath(__file__))
#: The rows also measured in a fresh process: the libraries that bind a meta model's weights.
FRESH_ROWS = ["torch.load(mmap) + assign", "safetensors + assign", "memtree to_module"]
ROWS = [
    "torch.load + load_state_dict",
    "torch.load(mmap) + assign",
    "safetensors + assign",
    "tensordict to_module",
    "tensorizer",
    "memtree to_module",
    "raw mmap + assign",
]


class Block(nn.Module):
    """A pre-norm transformer block (attention + MLP)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (
            self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    """A GPT-like encoder: token + position embeddings, blocks, final norm."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.register_buffer("pos_ids", torch.arange(max_len))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(self.pos_ids[: tokens.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)


def _dims(cfg: dict[str, Any]) -> dict[str, int]:
    if cfg["quick"]:
        return {"vocab": 500, "d": 64, "layers": 2, "heads": 4, "max_len": 64}
    return {"vocab": 32000, "d": 768, "layers": 12, "heads": 12, "max_len": 1024}


def _gpt2(cfg: dict[str, Any]) -> bool:
    return cfg.get("model", "w4") == "gpt2"


def _build(cfg: dict[str, Any]) -> nn.Module:
    if _gpt2(cfg):
        from transformers import GPT2Config, GPT2LMHeadModel

        small = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 500, "n_positions": 64}
        return GPT2LMHeadModel(GPT2Config(**(small if cfg["quick"] else {})))
    return Model(**_dims(cfg))


def _vocab(cfg: dict[str, Any]) -> int:
    return 500 if cfg["quick"] else 50257 if _gpt2(cfg) else _dims(cfg)["vocab"]


def _forward(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def _assign(model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """``load_state_dict(sd, assign=True)``; a model that ties weights (``transformers``' GPT-2:
    the head is the embedding, stored once) is tied again with its ``tie_weights()``."""
    tie = getattr(model, "tie_weights", None)
    result = model.load_state_dict(sd, assign=True, strict=tie is None)
    if tie is not None:
        tie()
        if result.unexpected_keys or any(p.is_meta for p in model.parameters()):
            raise RuntimeError(f"the checkpoint does not fit the model: {result}")


def _memtree_module_api() -> str | None:
    """None if memtree has from_module/to_module/empty_init, else why not."""
    import memtree

    missing = [n for n in ("from_module", "to_module") if not hasattr(memtree.TensorTree, n)]
    if not hasattr(memtree, "empty_init"):
        missing.append("empty_init")
    return f"N/A: memtree has no {', '.join(missing)} yet" if missing else None


def _wd(cfg: dict[str, Any]) -> str:
    return os.path.join(cfg["workdir"], "w4")


def systems(cfg: dict[str, Any]) -> list[str]:
    return list(ROWS)


def limit_of(row: Result) -> str | None:
    return "raw mmap + assign"


def _raw_layout(sd: dict[str, torch.Tensor]) -> list[tuple[str, int, tuple[int, ...], torch.dtype]]:
    out, at = [], 0
    for k, t in sd.items():
        out.append((k, at, tuple(t.shape), t.dtype))
        at += t.numel() * t.element_size()
    return out


def prepare(cfg: dict[str, Any]) -> str:
    """Build the original model, save it in every format, keep its output on a fixed input."""
    wd = _wd(cfg)
    os.makedirs(wd, exist_ok=True)
    torch.manual_seed(0)
    model = _build(cfg).eval()
    tokens = torch.randint(0, _vocab(cfg), (1, 16 if cfg["quick"] else 128))
    with torch.no_grad():
        out = _forward(model, tokens)
    torch.save({"tokens": tokens, "out": out}, os.path.join(wd, "ref.pt"))
    sd = model.state_dict()
    torch.save(sd, os.path.join(wd, "ckpt.pt"))
    with open(os.path.join(wd, "raw.bin"), "wb") as f:
        for t in sd.values():
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    try:
        from safetensors.torch import save_file

        # tied tensors (GPT-2's head): save_file refuses shared tensors; keep the first name, as
        # save_pretrained does (safetensors' save_model keeps lm_head.weight, which tie_weights
        # would then overwrite with the unloaded embedding)
        seen: set[int] = set()
        once = {k: v for k, v in sd.items() if not (v.data_ptr() in seen or seen.add(v.data_ptr()))}
        save_file(once, os.path.join(wd, "model.safetensors"))
    except ImportError:
        pass
    if _gpt2(cfg):  # only FRESH_ROWS and the raw limit
        from memtree import TensorTree

        TensorTree.from_module(model).memmap(os.path.join(wd, "memtree"))
        return f"GPT-2: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters"
    try:
        from tensordict import TensorDict

        TensorDict.from_module(model).memmap(os.path.join(wd, "td"))
    except ImportError:
        pass
    try:
        from tensorizer import TensorSerializer

        ser = TensorSerializer(os.path.join(wd, "model.tensors"))
        ser.write_module(model)
        ser.close()
    except ImportError:
        pass
    if _memtree_module_api() is None:
        from memtree import TensorTree

        TensorTree.from_module(model).memmap(os.path.join(wd, "memtree"))
    n = sum(t.numel() for t in sd.values())
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    return f"{n / 1e6:.1f}M parameters + buffers, {nbytes / 2**20:,.1f} MiB, {len(sd)} tensors"


def _loader(name: str, cfg: dict[str, Any]) -> tuple[Callable[[], nn.Module], list[str]]:
    """How the row builds a ready model, and the files it reads."""
    wd = _wd(cfg)
    meta = torch.device("meta")
    if name == "torch.load + load_state_dict":
        p = os.path.join(wd, "ckpt.pt")

        def ready() -> nn.Module:
            model = _build(cfg)
            model.load_state_dict(torch.load(p, weights_only=True))
            return model

        return ready, [p]
    if name == "torch.load(mmap) + assign":
        p = os.path.join(wd, "ckpt.pt")

        def ready() -> nn.Module:
            with meta:
                model = _build(cfg)
            _assign(model, torch.load(p, weights_only=True, mmap=True))
            return model

        return ready, [p]
    if name == "safetensors + assign":
        from safetensors.torch import load_file

        p = os.path.join(wd, "model.safetensors")

        def ready() -> nn.Module:
            with meta:
                model = _build(cfg)
            _assign(model, load_file(p))
            return model

        return ready, [p]
    if name == "tensordict to_module":
        from tensordict import TensorDict

        p = os.path.join(wd, "td")

        def ready() -> nn.Module:
            with meta:
                model = _build(cfg)
            TensorDict.load_memmap(p).to_module(model)
            return model

        return ready, [p]
    if name == "tensorizer":
        from tensorizer import TensorDeserializer
        from tensorizer.utils import no_init_or_tensor

        p = os.path.join(wd, "model.tensors")

        def ready() -> nn.Module:
            model = no_init_or_tensor(lambda: _build(cfg))
            deser = TensorDeserializer(p, device="cpu")
            deser.load_into_module(model)
            deser.close()
            return model

        return ready, [p]
    if name == "memtree to_module":
        import memtree

        p = os.path.join(wd, "memtree")

        def ready() -> nn.Module:
            with memtree.empty_init():  # type: ignore[attr-defined]
                model = _build(cfg)
            memtree.load_memmap(p).to_module(model)  # type: ignore[attr-defined]
            return model

        return ready, [p]
    if name == "raw mmap + assign":
        p = os.path.join(wd, "raw.bin")
        with meta:
            layout = _raw_layout(_build(cfg).state_dict())

        def ready() -> nn.Module:
            with meta:
                model = _build(cfg)
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sd = {
                    k: torch.frombuffer(
                        mm, dtype=dt, count=torch.Size(shape).numel(), offset=off
                    ).view(shape)
                    for k, off, shape, dt in layout
                }
            _assign(model, sd)
            return model

        return ready, [p]
    raise ValueError(name)


def fresh_ready(name: str, cfg: dict[str, Any], how: str = "spawn") -> dict[str, Any]:
    """Time ``name``'s ``ready`` in a new process; see the module docstring.

    ``how="spawn"``: a new interpreter, which imports torch (and transformers' GPT-2 module)
    untimed; the row's library import is timed. ``how="fork"``: a child of this process (whose
    imports it inherits, so the library imports are not timed: call :func:`fork_parent_imports`
    first); the child's intra-op threads are limited to one after the timed part, for the check.

    Returns:
        ``{"seconds": .., "equal": the output equals the original's, "dynamo": torch._dynamo
        was imported when the model was ready}``
    """
    args = json.dumps({"name": name, "cfg": {k: cfg.get(k) for k in ("quick", "workdir", "model")}})
    if how == "fork":
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            status = 1
            try:
                os.close(read)
                with os.fdopen(write, "w") as out:
                    out.write(_fresh_child(args, forked=True))
                status = 0
            finally:
                os._exit(status)
        os.close(write)
        with os.fdopen(read) as got:
            doc = got.read()
        _, status = os.waitpid(pid, 0)
        if status or not doc:
            raise RuntimeError(f"{name}: the forked process failed (status {status})")
        return json.loads(doc)
    code = f"import sys; sys.path.insert(0, {HERE!r}); import w4_model; print(w4_model._fresh_child({args!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{name}: the fresh process failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def fork_parent_imports(cfg: dict[str, Any]) -> None:
    """What a forked :func:`fresh_ready` child inherits: every row's library, imported."""
    import memtree  # noqa: F401
    import safetensors.torch  # noqa: F401

    if _gpt2(cfg):
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401


def _fresh_child(args_json: str, forked: bool = False) -> str:
    args = json.loads(args_json)
    cfg = args["cfg"]
    if _gpt2(cfg):
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401  (every row imports it alike)
    t0 = time.perf_counter()
    ready, _ = _loader(args["name"], cfg)
    model = ready()
    seconds = time.perf_counter() - t0
    dynamo = "torch._dynamo" in sys.modules
    if forked:
        torch.set_num_threads(1)  # as DataLoader workers do: the parent's thread pool is gone
    ref = torch.load(os.path.join(_wd(cfg), "ref.pt"))
    with torch.no_grad():
        equal = torch.equal(_forward(model.eval(), ref["tokens"]), ref["out"])
    return json.dumps({"seconds": seconds, "equal": equal, "dynamo": dynamo})


def run_system(name: str, cfg: dict[str, Any]) -> list[Result]:
    if name == "memtree to_module" and _memtree_module_api() is not None:
        return [Result("w4", name, "*", note=str(_memtree_module_api()))]
    try:
        ready, files = _loader(name, cfg)
    except ImportError as err:
        return [Result("w4", name, "*", note=f"N/A: {err}")]
    settings = Settings(**cfg["settings"])
    ref = torch.load(os.path.join(_wd(cfg), "ref.pt"))
    rows: list[Result] = []
    caches = ["warm"] if settings.cold == "none" else ["warm", "cold"]
    app, alloc, n = disk_usage(files)
    is_limit = name == "raw mmap + assign"
    for cache in caches:
        cold = (lambda: files) if cache == "cold" else None
        sec, runs, rss, anon, note = measure(settings, lambda _: ready(), cold_paths=cold)
        rows.append(
            Result("w4", name, "ready", cache, sec, runs, rss, anon, app, alloc, n, is_limit, note)
        )
        verdicts: list[str] = []

        def forward(model: nn.Module) -> torch.Tensor:
            with torch.no_grad():
                return _forward(model.eval(), ref["tokens"])

        def check(_: Any, out: torch.Tensor) -> None:
            if torch.equal(out, ref["out"]):
                verdicts.append("output equal")
            else:
                verdicts.append(
                    f"OUTPUT DIFFERS (max abs {float((out - ref['out']).abs().max()):.3g})"
                )

        sec, runs, rss, anon, note = measure(
            settings, forward, setup=ready, teardown=check, cold_paths=cold
        )
        note = "; ".join(x for x in [note, *sorted(set(verdicts))] if x)
        rows.append(
            Result(
                "w4", name, "first forward", cache, sec, runs, rss, anon, limit=is_limit, note=note
            )
        )
    if name in FRESH_ROWS:
        fresh = [fresh_ready(name, cfg) for _ in range(settings.warmup + settings.repeat)]
        runs = [r["seconds"] for r in fresh[settings.warmup :]]
        note = "; ".join(
            sorted({"output equal" if r["equal"] else "OUTPUT DIFFERS" for r in fresh})
            + sorted({"imported torch._dynamo" for r in fresh if r["dynamo"]})
        )
        rows.append(
            Result("w4", name, "ready, fresh process", "warm", statistics.median(runs), runs, note=note)
        )
    return rows
