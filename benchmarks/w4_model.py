"""W4 model: a saved ~110M-parameter transformer made ready to run, up to its first output.

Every system starts from the *same* model skeleton, built untimed before each run by the same
construction (``memtree.empty_init()``: every parameter and buffer on the meta device, no
initialisation; the rows that copy into existing tensors then allocate it with
``to_empty(device="cpu")``, untimed too). Construction is left out everywhere: what differs
between the systems, and what is timed, is loading, binding and the first forward pass, up to
the output, which is compared bit for bit with the original model's after every run.

Systems (``ROWS``):

* ``torch.load + load_state_dict``: allocated skeleton, ``load_state_dict(torch.load(f))``;
* ``torch.load(mmap) + assign``: ``load_state_dict(torch.load(f, mmap=True), assign=True)``;
* ``safetensors + assign``: ``load_state_dict(safetensors.torch.load_file(f), assign=True)``;
* ``tensordict to_module``: ``TensorDict.load_memmap(d).to_module(model)``;
* ``tensorizer``: allocated skeleton, ``TensorDeserializer(f).load_into_module(model)``;
* ``memtree to_module``: ``memtree.load_memmap(d).to_module(model)``;
* ``raw mmap + assign`` (the limit): one raw file mapped, ``torch.frombuffer`` views,
  ``load_state_dict(assign=True)``.

Comparisons: ``load+bind+forward`` (the model ready to run: its first output), warm and cold
(cold: the files evicted and checked with ``mincore`` before every run); ``load+bind`` (without
the forward: its peak RSS is what binding costs); ``first forward`` (the forward alone, after
an untimed load + bind; warm only: the pages of a file a bound model maps cannot be evicted); and
``fresh process
load+bind+forward`` for W4's model and for ``transformers``' GPT-2 (124M parameters, tied
embeddings; skipped where ``transformers`` is missing): each run in a new interpreter that
imports torch, the model's module, memtree (for the construction) and the row's library
untimed, builds the skeleton untimed, then times load + bind + first forward and reports the
output's digest, which the parent checks.
"""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from checks import CheckFailed, as_digest, digest, expect_equal
from harness import Comparison, System, wanted

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = [
    "torch.load + load_state_dict",
    "torch.load(mmap) + assign",
    "safetensors + assign",
    "tensordict to_module",
    "tensorizer",
    "memtree to_module",
    "raw mmap + assign",
]
#: The rows whose skeleton is allocated (they copy into existing tensors).
ALLOCATED = ("torch.load + load_state_dict", "tensorizer")
#: The rows of the fresh-process comparisons in a ``--quick`` run (a smoke test: each spawned
#: interpreter imports torch and transformers), warm only.
QUICK_FRESH = ("safetensors + assign", "memtree to_module")
#: The library each row needs (``memtree`` rows need memtree; the raw limit nothing more).
REQUIRES = {"safetensors + assign": "safetensors", "tensordict to_module": "tensordict", "tensorizer": "tensorizer"}


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


def _assign(model: nn.Module, sd: dict[str, torch.Tensor]) -> nn.Module:
    """``load_state_dict(sd, assign=True)``; a model that ties weights (``transformers``' GPT-2:
    the head is the embedding, stored once) is tied again with its ``tie_weights()``."""
    tie = getattr(model, "tie_weights", None)
    result = model.load_state_dict(sd, assign=True, strict=tie is None)
    if tie is not None:
        tie()
        if result.unexpected_keys or any(p.is_meta for p in model.parameters()):
            raise RuntimeError(f"the checkpoint does not fit the model: {result}")
    return model


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
    for what, write in (("td", _save_tensordict), ("model.tensors", _save_tensorizer)):
        try:
            write(model, os.path.join(wd, what))
        except ImportError:
            pass
        except Exception as err:  # noqa: BLE001 - the row then says it cannot run
            print(f"{what}: could not save this model ({type(err).__name__}: {err})", flush=True)
    from memtree import TensorTree

    TensorTree.from_module(model).memmap(os.path.join(wd, "memtree"))
    name = "GPT-2" if _gpt2(cfg) else "W4"
    n = sum(t.numel() for t in sd.values())
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    return f"{name}: {n / 1e6:.1f}M parameters + buffers, {nbytes / 2**20:,.1f} MiB, {len(sd)} tensors"


def _save_tensordict(model: nn.Module, path: str) -> None:
    from tensordict import TensorDict

    TensorDict.from_module(model).memmap(path)


def _save_tensorizer(model: nn.Module, path: str) -> None:
    from tensorizer import TensorSerializer

    ser = TensorSerializer(path)
    ser.write_module(model)
    ser.close()


def _wd(cfg: dict[str, Any]) -> str:
    return os.path.join(cfg["workdir"], "w4" if not _gpt2(cfg) else "w4-gpt2")


def skeleton(cfg: dict[str, Any], allocated: bool) -> nn.Module:
    """The model built the same way for every system: ``memtree.empty_init()`` (meta tensors, no
    initialisation), allocated (uninitialised) when ``allocated``."""
    import memtree

    with memtree.empty_init():
        model = _build(cfg)
    if allocated:
        model.to_empty(device="cpu")
    return model


def _binder(name: str, cfg: dict[str, Any]) -> tuple[Callable[[nn.Module], nn.Module], list[str]]:
    """How the row loads the checkpoint into a skeleton, and the files it reads."""
    wd = _wd(cfg)
    if name == "torch.load + load_state_dict":
        p = os.path.join(wd, "ckpt.pt")

        def bind(model: nn.Module) -> nn.Module:
            model.load_state_dict(torch.load(p, weights_only=True))
            return model

        return bind, [p]
    if name == "torch.load(mmap) + assign":
        p = os.path.join(wd, "ckpt.pt")
        return (lambda model: _assign(model, torch.load(p, weights_only=True, mmap=True))), [p]
    if name == "safetensors + assign":
        from safetensors.torch import load_file

        p = os.path.join(wd, "model.safetensors")
        return (lambda model: _assign(model, load_file(p))), [p]
    if name == "tensordict to_module":
        from tensordict import TensorDict

        p = os.path.join(wd, "td")

        def bind_td(model: nn.Module) -> nn.Module:
            TensorDict.load_memmap(p).to_module(model)
            return model

        return bind_td, [p]
    if name == "tensorizer":
        from tensorizer import TensorDeserializer

        p = os.path.join(wd, "model.tensors")

        def bind_tz(model: nn.Module) -> nn.Module:
            deser = TensorDeserializer(p, device="cpu")
            deser.load_into_module(model)
            deser.close()
            return model

        return bind_tz, [p]
    if name == "memtree to_module":
        import memtree

        p = os.path.join(wd, "memtree")

        def bind_mt(model: nn.Module) -> nn.Module:
            memtree.load_memmap(p).to_module(model)
            return model

        return bind_mt, [p]
    if name == "raw mmap + assign":
        p = os.path.join(wd, "raw.bin")
        layout = _raw_layout(skeleton(cfg, allocated=False).state_dict())

        def bind_raw(model: nn.Module) -> nn.Module:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            finally:
                os.close(fd)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sd = {
                    k: torch.frombuffer(mm, dtype=dt, count=torch.Size(shape).numel(), offset=off).view(shape)
                    for k, off, shape, dt in layout
                }
            return _assign(model, sd)

        return bind_raw, [p]
    raise ValueError(name)


def _missing(name: str, cfg: dict[str, Any]) -> str | None:
    """Why the row cannot run here, or None."""
    needs = [REQUIRES.get(name, "memtree")] + (["transformers"] if _gpt2(cfg) else [])
    for mod in needs:
        try:
            __import__(mod)
        except Exception as err:  # noqa: BLE001 - any import failure means "not available"
            return f"N/A: {mod} not importable ({type(err).__name__}: {err})"
    if not os.path.exists(_binder_files(name, cfg)):
        return f"N/A: {name} could not save this model"
    return None


def _binder_files(name: str, cfg: dict[str, Any]) -> str:
    files = {"torch.load + load_state_dict": "ckpt.pt", "torch.load(mmap) + assign": "ckpt.pt",
             "safetensors + assign": "model.safetensors", "tensordict to_module": "td",
             "tensorizer": "model.tensors", "memtree to_module": "memtree", "raw mmap + assign": "raw.bin"}
    return os.path.join(_wd(cfg), files[name])


def _forward_output(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _forward(model.eval(), tokens)


def describe(cfg: dict[str, Any]) -> str:
    d = _dims(cfg)
    return f"a GPT-like model, d {d['d']}, {d['layers']} blocks, vocab {d['vocab']}; and GPT-2 in fresh processes"


def comparisons(cfg: dict[str, Any]) -> Iterator[Comparison]:
    rows = [r for r in ROWS if wanted(r, cfg)]
    print(prepare(cfg), flush=True)
    ref = torch.load(os.path.join(_wd(cfg), "ref.pt"))
    for cache in cfg["caches"]:
        yield Comparison("load+bind+forward", cache, [_in_process(r, cfg, ref, "load+bind+forward") for r in rows])
    if "warm" in cfg["caches"]:  # cold would need the pages a bound model maps evicted: impossible
        for part in ("load+bind", "first forward"):
            yield Comparison(part, "warm", [_in_process(r, cfg, ref, part) for r in rows])
    fresh_rows = [r for r in rows if r != "raw mmap + assign" and (r in QUICK_FRESH or not cfg["quick"])]
    fresh_caches = ["warm"] if cfg["quick"] else cfg["caches"]
    for model in ("w4", "gpt2"):
        mcfg = dict(cfg, model=model)
        if model == "gpt2":
            try:
                import transformers  # noqa: F401
            except ImportError as err:
                why = f"N/A: transformers not importable ({err})"
                yield Comparison("fresh process load+bind+forward (gpt2)", "warm",
                                 [System(r, run=lambda _: None, check=lambda s, o: None, missing=why)
                                  for r in fresh_rows])
                continue
            print(prepare(mcfg), flush=True)
        mref = torch.load(os.path.join(_wd(mcfg), "ref.pt"))
        for cache in fresh_caches:
            yield Comparison(f"fresh process load+bind+forward ({model})", cache,
                             [_fresh(r, mcfg, mref) for r in fresh_rows])
    if wanted("memtree", cfg):
        yield Comparison("fresh process import", "", [_import_memtree()])


def _in_process(name: str, cfg: dict[str, Any], ref: dict[str, torch.Tensor], part: str) -> System:
    """``part``: ``load+bind+forward`` (timed to the first output), ``load+bind`` (the output
    computed after the timing, for the check) or ``first forward`` (load + bind untimed)."""
    missing = _missing(name, cfg)
    if missing is not None:
        return System(name, run=lambda _: None, check=lambda s, o: None, missing=missing)
    bind, files = _binder(name, cfg)
    allocated = name in ALLOCATED
    nbytes = os.path.getsize(os.path.join(_wd(cfg), "raw.bin"))  # the model's bytes
    setup: Callable[[], Any] = lambda: skeleton(cfg, allocated)  # noqa: E731
    if part == "first forward":
        setup = lambda: bind(skeleton(cfg, allocated))  # noqa: E731
        run: Callable[[Any], Any] = lambda model: _forward_output(model, ref["tokens"])  # noqa: E731
    elif part == "load+bind":
        run = bind
    else:
        run = lambda model: _forward_output(bind(model), ref["tokens"])  # noqa: E731

    def check(_: Any, out: Any) -> dict[str, float]:
        if part == "load+bind":
            out = _forward_output(out, ref["tokens"])
        expect_equal(out, ref["out"], f"{name}: the model's first output")
        return {"model bytes": float(nbytes)}

    return System(name, run=run, check=check, setup=setup, files=files, limit=name == "raw mmap + assign")


def _fresh(name: str, cfg: dict[str, Any], ref: dict[str, torch.Tensor]) -> System:
    missing = _missing(name, cfg)
    if missing is not None:
        return System(name, run=lambda _: None, check=lambda s, o: None, missing=missing)
    _, files = _binder(name, cfg)
    want = digest(ref["out"])

    def check(_: Any, got: dict[str, Any]) -> dict[str, float]:
        if as_digest(got["digest"]) != want:
            raise CheckFailed(f"{name}: the first output in a fresh process differs from the original's")
        return {"child import s": got["import_seconds"]}

    return System(name, run=lambda _: fresh_run(name, cfg), check=check, files=files, own_time=True)


def _import_memtree() -> System:
    """``import memtree`` in a new interpreter that imported torch first (untimed)."""
    code = ("import sys, time, torch; t0 = time.perf_counter(); import memtree; "
            "print(time.perf_counter() - t0); print(memtree.__file__)")

    def run(_: Any) -> tuple[float, str]:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              cwd=os.path.dirname(HERE))
        if proc.returncode:
            raise RuntimeError(f"import memtree failed:\n{proc.stderr[-3000:]}")
        seconds, where = proc.stdout.split()[-2:]
        return float(seconds), where

    def check(_: Any, where: str) -> None:
        import memtree

        if os.path.realpath(where) != os.path.realpath(memtree.__file__):
            raise CheckFailed(f"the child imported memtree from {where}, not {memtree.__file__}")

    return System("memtree", run=run, check=check, own_time=True)


def fresh_run(name: str, cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Load + bind + first forward of row ``name`` in a new interpreter; see the module docstring.

    Returns:
        (seconds, ``{"digest": the output's digest, "import_seconds": the untimed imports}``)
    """
    args = json.dumps({"name": name, "cfg": {k: cfg.get(k) for k in ("quick", "workdir", "model")}})
    code = f"import sys; sys.path.insert(0, {HERE!r}); import w4_model; print(w4_model._fresh_child({args!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{name}: the fresh process failed:\n{proc.stderr[-3000:]}")
    doc = json.loads(proc.stdout.splitlines()[-1])
    return doc.pop("seconds"), doc


def _fresh_child(args_json: str) -> str:
    args = json.loads(args_json)
    cfg, name = args["cfg"], args["name"]
    t0 = time.perf_counter()
    if _gpt2(cfg):
        import transformers.models.gpt2.modeling_gpt2  # noqa: F401
    import memtree  # noqa: F401  (the construction's empty_init)

    mod = REQUIRES.get(name)
    if mod is not None:
        __import__(mod)
    bind, _ = _binder(name, cfg)
    ref = torch.load(os.path.join(_wd(cfg), "ref.pt"))
    model = skeleton(cfg, name in ALLOCATED)
    imports = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = _forward_output(bind(model), ref["tokens"])
    seconds = time.perf_counter() - t0
    return json.dumps({"seconds": seconds, "digest": list(digest(out)), "import_seconds": imports})
