"""Tests for cutedsl_attn.compile (arch selection, config keys, kernel cache).

CPU-only and real: the disk-cache tests compile a tiny CuTe DSL kernel
(y = 2x + 1 on fp32, dynamic length) for sm_90a and sm_100a without a GPU.
The concurrency test imports this module in two child processes
(``_child_main``).
"""

import dataclasses
import enum
import functools
import glob
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from cutedsl_attn.compile import (  # noqa: E402
    arch_major,
    cache_fingerprint,
    cache_stats,
    clear_memory_cache,
    compile_options,
    config_key,
    get_compiled,
    hash_callable,
    is_cross_compiling,
    normalize_arch,
    target_arch,
)
from cutedsl_attn.compile import cache as cache_mod  # noqa: E402

ARCH_ENV = "CUTEDSL_ATTN_ARCH"


# ---------------------------------------------------------------------------
# tiny kernel (built lazily: importing cutlass costs ~1 s)
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _ew_jit():
    import cutlass
    import cutlass.cute as cute

    @cute.kernel
    def ew_kernel(x: cute.Tensor, y: cute.Tensor, n: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * 128 + tidx
        if i < n:
            y[i] = x[i] * 2.0 + 1.0

    @cute.jit
    def ew(x: cute.Tensor, y: cute.Tensor, stream):
        n = cute.size(x, mode=[0])
        ew_kernel(x, y, n).launch(grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream)

    return ew


@dataclasses.dataclass(frozen=True)
class EwCfg:
    tag: str = "t"
    arch: str = "sm_90a"


def build_ew(cfg: EwCfg, *, ptx_dir=None, counter=None, sleep_s: float = 0.0):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    if counter is not None:
        counter.append(cfg)
    n = cute.sym_int()
    fx = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    fy = make_fake_compact_tensor(cutlass.Float32, (n,), assumed_align=16)
    fn = cute.compile(
        _ew_jit(), fx, fy, make_fake_stream(use_tvm_ffi_env_stream=True),
        options=compile_options(cfg.arch, keep_ptx_dir=ptx_dir),
    )
    if sleep_s:
        time.sleep(sleep_s)
    return fn


def _scaled(s):
    return lambda x: x * s


@dataclasses.dataclass(frozen=True)
class KeyCfg:
    head_dim: int = 128
    causal: bool = False
    dtype: str = "bf16"
    scale: float = 0.5
    tiles: tuple = (128, 64)
    score_mod: object = None
    arch: str = "sm_90a"


def _key_of_closure_cfg() -> str:
    return config_key(KeyCfg(score_mod=_scaled(3.0)))


# ---------------------------------------------------------------------------
# child process (concurrency test)
# ---------------------------------------------------------------------------


def _child_main(cache_dir: str, tag: str) -> None:  # runs in a subprocess
    os.environ["CUTEDSL_ATTN_CACHE_DIR"] = cache_dir
    os.environ.pop("CUTEDSL_ATTN_DISABLE_DISK_CACHE", None)
    cfg = EwCfg(tag=tag, arch="sm_90a")
    get_compiled("ew_conc", cfg, functools.partial(build_ew, sleep_s=1.0))
    (st,) = cache_stats().values()
    print("RESULT " + json.dumps({"source": st["source"], "key": st["key"], "closure_key": _key_of_closure_cfg()}))


import pytest  # noqa: E402


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("CUTEDSL_ATTN_CACHE_DIR", str(d))
    monkeypatch.delenv("CUTEDSL_ATTN_DISABLE_DISK_CACHE", raising=False)
    clear_memory_cache(reset_stats=True)
    yield d
    clear_memory_cache(reset_stats=True)


def _fake_cuda(monkeypatch, cap):
    import torch

    if cap is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)


def _files(d: Path):
    return sorted(p for p in d.rglob("*") if p.is_file()) if d.exists() else []


def _gpu_can_load(arch: str) -> bool:
    """True where a loaded artifact of ``arch`` is expected here: no GPU (the
    DSL loader works without a driver) or a GPU of the same arch."""
    from cutedsl_attn.compile import device_arch

    dev = device_arch()
    return dev is None or dev == arch


# ---------------------------------------------------------------------------
# arch
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value,expected",
    [
        ("sm_90a", "sm_90a"), ("hopper", "sm_90a"), ("sm90", "sm_90a"), (" Hopper ", "sm_90a"),
        ("sm_100a", "sm_100a"), ("blackwell", "sm_100a"), ("sm100", "sm_100a"),
        ("sm_103a", "sm_103a"), ("sm103", "sm_103a"),
    ],
)
def test_target_arch_env(monkeypatch, value, expected):
    _fake_cuda(monkeypatch, (9, 0))  # env wins over the device
    monkeypatch.setenv(ARCH_ENV, value)
    assert target_arch() == expected


@pytest.mark.parametrize("bad", ["sm_80", "ampere", "sm_90", "100", "sm_100"])
def test_target_arch_env_invalid(monkeypatch, bad):
    monkeypatch.setenv(ARCH_ENV, bad)
    with pytest.raises(ValueError) as ei:
        target_arch()
    assert ARCH_ENV in str(ei.value) and "sm_90a" in str(ei.value) and "blackwell" in str(ei.value)


@pytest.mark.parametrize("cap,expected", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), "sm_103a")])
def test_target_arch_from_device(monkeypatch, cap, expected):
    monkeypatch.delenv(ARCH_ENV, raising=False)
    _fake_cuda(monkeypatch, cap)
    assert target_arch() == expected
    assert target_arch("cuda:0") == expected
    assert is_cross_compiling() is False


def test_target_arch_unsupported_device(monkeypatch):
    monkeypatch.delenv(ARCH_ENV, raising=False)
    _fake_cuda(monkeypatch, (8, 0))
    with pytest.raises(NotImplementedError) as ei:
        target_arch()
    msg = str(ei.value)
    assert "8.0" in msg and "9.0" in msg and "10.0" in msg and "10.3" in msg


def test_target_arch_no_cuda(monkeypatch):
    monkeypatch.delenv(ARCH_ENV, raising=False)
    _fake_cuda(monkeypatch, None)
    with pytest.raises(RuntimeError, match=ARCH_ENV):
        target_arch()
    assert is_cross_compiling() is True
    monkeypatch.setenv(ARCH_ENV, "hopper")
    assert target_arch() == "sm_90a"
    assert is_cross_compiling() is True


def test_is_cross_compiling_env_vs_device(monkeypatch):
    _fake_cuda(monkeypatch, (9, 0))
    monkeypatch.setenv(ARCH_ENV, "sm_100a")
    assert is_cross_compiling() is True
    monkeypatch.setenv(ARCH_ENV, "hopper")
    assert is_cross_compiling() is False


def test_arch_major_and_normalize():
    assert arch_major("sm_90a") == 90
    assert arch_major("blackwell") == 100
    assert arch_major("sm_103a") == 103
    assert normalize_arch("SM100") == "sm_100a"
    with pytest.raises(ValueError):
        arch_major("sm_80")


def test_compile_options(tmp_path):
    assert compile_options("hopper") == "--gpu-arch sm_90a --enable-tvm-ffi"
    assert compile_options("sm_100a", tvm_ffi=False) == "--gpu-arch sm_100a"
    d = tmp_path / "ptx dir"
    opts = compile_options("sm_90a", keep_ptx_dir=d)
    assert d.is_dir()  # created: the DSL silently writes nothing into a missing dir
    assert "--keep-ptx" in opts and "--dump-dir" in opts
    with pytest.raises(ValueError):
        compile_options("sm_90a", keep_cubin=True)
    with pytest.raises(ValueError):
        compile_options("sm_80")


# ---------------------------------------------------------------------------
# config_key
# ---------------------------------------------------------------------------


class Mode(enum.Enum):
    A = 1
    B = 2


def test_config_key_stable_and_sensitive():
    base = KeyCfg()
    assert config_key(base) == config_key(KeyCfg()) == config_key(base)
    changes = dict(head_dim=64, causal=True, dtype="fp16", scale=0.25, tiles=(64, 64),
                   score_mod=_scaled(2.0), arch="sm_100a")
    keys = {config_key(base)}
    for name, value in changes.items():
        k = config_key(dataclasses.replace(base, **{name: value}))
        assert k not in keys, name
        keys.add(k)
    # field names appear, in order
    k = config_key(base)
    assert k.index("head_dim=") < k.index("causal=") < k.index("arch=")


def test_config_key_types_distinguished():
    import torch

    assert config_key(KeyCfg(head_dim=1)) != config_key(KeyCfg(head_dim=True))
    assert config_key(KeyCfg(head_dim=1)) != config_key(KeyCfg(head_dim=1.0))
    assert config_key(KeyCfg(tiles=(1, 2))) != config_key(KeyCfg(tiles=(1.0, 2)))
    assert config_key(KeyCfg(dtype=torch.float16)) != config_key(KeyCfg(dtype=torch.bfloat16))
    assert config_key(KeyCfg(dtype=Mode.A)) != config_key(KeyCfg(dtype=Mode.B))
    assert config_key(KeyCfg(dtype=int)) != config_key(KeyCfg(dtype=float))
    assert config_key(KeyCfg(tiles=frozenset({"b", "a"}))) == config_key(KeyCfg(tiles=frozenset({"a", "b"})))


def test_config_key_callables():
    f2, g2, f3 = _scaled(2.0), _scaled(2.0), _scaled(3.0)
    assert config_key(KeyCfg(score_mod=f2)) == config_key(KeyCfg(score_mod=g2))  # same source + closure
    assert config_key(KeyCfg(score_mod=f2)) != config_key(KeyCfg(score_mod=f3))  # closure differs
    a, b = (lambda x: x + 1), (lambda x: x + 2)  # same source line, different code
    assert hash_callable(a) != hash_callable(b)

    def with_default(x, s=1.0):
        return x * s

    def with_default2(x, s=2.0):
        return x * s

    assert hash_callable(with_default) != hash_callable(with_default2)
    p1, p2 = functools.partial(with_default, s=1.0), functools.partial(with_default, s=3.0)
    assert hash_callable(p1) != hash_callable(p2)
    assert hash_callable(max) == hash_callable(max)
    tagged = _scaled(5.0)
    tagged.__cute_hash__ = "mine"
    assert hash_callable(tagged) != hash_callable(_scaled(5.0))


_BIAS_TABLE = (0.5, 0.25)
_BIAS_SCALE = 1.0


def _uses_globals(x, h):
    return x * _BIAS_SCALE + _BIAS_TABLE[0] + _helper_mod.OFFSET + _helper_mod.shift(x)


def test_hash_callable_referenced_globals(monkeypatch, tmp_path):
    """Every global a function references is part of its hash (so of a disk-cached kernel's key): primitives,
    tuples (by value), and a user module's attributes the code names (values and functions by source)."""
    global _helper_mod
    mod_path = tmp_path / "score_helpers.py"
    mod_path.write_text("OFFSET = 1.0\ndef shift(x):\n    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    _helper_mod = importlib.import_module("score_helpers")
    base = hash_callable(_uses_globals)
    assert hash_callable(_uses_globals) == base
    for name, value in (("_BIAS_TABLE", (0.9, 0.25)), ("_BIAS_SCALE", 2.0)):
        monkeypatch.setitem(globals(), name, value)
        assert hash_callable(_uses_globals) != base, name
        monkeypatch.undo()
        monkeypatch.syspath_prepend(str(tmp_path))
    assert hash_callable(_uses_globals) == base
    monkeypatch.setattr(_helper_mod, "OFFSET", 2.0)
    assert hash_callable(_uses_globals) != base
    monkeypatch.setattr(_helper_mod, "OFFSET", 1.0)
    exec("def shift(x):\n    return x + 2\n", _helper_mod.__dict__)  # the helper's code changes
    assert hash_callable(_uses_globals) != base


_helper_mod = None


def test_get_compiled_sees_a_changed_global(cache_dir, monkeypatch):
    """A config holding a callable skips the equality memo: a global changed after the first use gives a new
    build (the key re-derived), the unchanged one the cached build."""
    monkeypatch.setenv("CUTEDSL_ATTN_DISABLE_DISK_CACHE", "1")
    calls = []

    def build(cfg):
        calls.append(cfg)
        return object()

    f = _uses_globals_simple
    a = get_compiled("fake_g", KeyCfg(score_mod=f), build)
    assert get_compiled("fake_g", KeyCfg(score_mod=f), build) is a and len(calls) == 1
    monkeypatch.setitem(globals(), "_BIAS_SCALE", 3.0)
    b = get_compiled("fake_g", KeyCfg(score_mod=f), build)
    assert b is not a and len(calls) == 2


def _uses_globals_simple(x, h):
    return x * _BIAS_SCALE


def test_config_key_rejects():
    with pytest.raises(TypeError, match="unhashable"):
        config_key(KeyCfg(tiles=[128, 64]))
    with pytest.raises(TypeError, match="unhashable"):
        config_key(KeyCfg(score_mod={"a": 1}))

    @dataclasses.dataclass
    class Mutable:
        x: int = 1

    with pytest.raises(TypeError, match="frozen"):
        config_key(Mutable())
    with pytest.raises(TypeError):
        config_key((1, 2))
    with pytest.raises(TypeError, match="no stable key"):
        config_key(KeyCfg(dtype=object()))


# ---------------------------------------------------------------------------
# get_compiled: memory layer (fake builds, no DSL)
# ---------------------------------------------------------------------------


def test_memory_cache_and_args(cache_dir, monkeypatch):
    monkeypatch.setenv("CUTEDSL_ATTN_DISABLE_DISK_CACHE", "1")
    calls = []

    def build(cfg):
        calls.append(cfg)
        return object()

    a = get_compiled("fake", KeyCfg(), build)
    assert get_compiled("fake", KeyCfg(), build) is a
    assert len(calls) == 1
    assert get_compiled("fake", KeyCfg(head_dim=True), build) is not a  # True == 1 but not the same kernel
    get_compiled("fake", KeyCfg(head_dim=64), build)
    assert len(calls) == 3
    assert get_compiled("fake", KeyCfg(score_mod=_scaled(2.0)), build) is get_compiled(
        "fake", KeyCfg(score_mod=_scaled(2.0)), build)
    assert len(calls) == 4
    with pytest.raises(ValueError, match="contradicts"):
        get_compiled("fake", KeyCfg(), build, arch="sm_100a")
    with pytest.raises(ValueError):
        get_compiled("bad/name", KeyCfg(), build)
    with pytest.raises(TypeError, match="unhashable"):
        get_compiled("fake", KeyCfg(tiles=[1]), build)
    with pytest.raises(TypeError, match="None"):
        get_compiled("none", KeyCfg(), lambda c: None)
    assert not cache_dir.exists()

    @dataclasses.dataclass(frozen=True)
    class NoArch:
        x: int = 1

    monkeypatch.setenv(ARCH_ENV, "sm_90a")
    f90 = get_compiled("noarch", NoArch(), build)
    f100 = get_compiled("noarch", NoArch(), build, arch="sm_100a")
    assert f90 is not f100 and get_compiled("noarch", NoArch(), build) is f90
    assert {k[1].rsplit("@", 1)[1] for k in cache_stats() if k[0] == "noarch"} == {"sm_90a", "sm_100a"}


@dataclasses.dataclass(frozen=True)
class _Problem:
    head_dim: int = 128
    score_mod: object = None
    arch: str = "sm_90a"


@dataclasses.dataclass(frozen=True)
class _Tiles:
    tile_m: int = 128
    tile_n: tuple = (64,)


@dataclasses.dataclass(frozen=True)
class _NestedCfg:
    """The kernels' ``Config(problem, tiles)`` shape: the arch lives in ``problem``."""
    problem: _Problem = _Problem()
    tiles: _Tiles = _Tiles()


def test_nested_config_arch_memo_and_callables(cache_dir, monkeypatch):
    from cutedsl_attn.compile import config_arch

    monkeypatch.setenv("CUTEDSL_ATTN_DISABLE_DISK_CACHE", "1")
    monkeypatch.delenv(ARCH_ENV, raising=False)
    calls = []

    def build(cfg):
        calls.append(cfg)
        return object()

    assert config_arch(_NestedCfg()) == "sm_90a"
    assert config_arch(_NestedCfg(problem=_Problem(arch="sm_100a"))) == "sm_100a"
    assert config_arch(KeyCfg(arch="sm_100a")) == "sm_100a" and config_arch(_Tiles()) is None
    # the nested arch is the target: no device or env needed, no "@arch" suffix on the key
    cfg = _NestedCfg()
    a = get_compiled("nested", cfg, build)
    assert get_compiled("nested", cfg, build) is a  # the identity memo
    assert get_compiled("nested", _NestedCfg(), build) is a and len(calls) == 1  # the equality memo
    assert get_compiled("nested2", cfg, build) is not a and len(calls) == 2  # another kernel name
    calls.pop()
    assert all("@" not in k[1] for k in cache_stats() if k[0] == "nested")
    with pytest.raises(ValueError, match="contradicts"):
        get_compiled("nested", _NestedCfg(), build, arch="sm_100a")
    # values equal across types at depth (1 == 1.0 == True) are other kernels
    b = get_compiled("nested", _NestedCfg(tiles=_Tiles(tile_n=(64.0,))), build)
    c = get_compiled("nested", _NestedCfg(problem=_Problem(head_dim=128.0)), build)
    assert len({id(a), id(b), id(c)}) == 3 and len(calls) == 3
    # a callable in a nested part skips the memo: a changed global is another kernel
    f = _uses_globals_simple
    d = get_compiled("nested", _NestedCfg(problem=_Problem(score_mod=f)), build)
    assert get_compiled("nested", _NestedCfg(problem=_Problem(score_mod=f)), build) is d and len(calls) == 4
    monkeypatch.setitem(globals(), "_BIAS_SCALE", 5.0)
    assert get_compiled("nested", _NestedCfg(problem=_Problem(score_mod=f)), build) is not d
    assert len(calls) == 5


# ---------------------------------------------------------------------------
# get_compiled: disk layer with a real kernel
# ---------------------------------------------------------------------------


def test_disk_cache_cross_arch_and_ptx(cache_dir, tmp_path):
    pytest.importorskip("cutlass")
    calls = []
    paths = {}
    for arch in ("sm_90a", "sm_100a"):
        cfg = EwCfg(tag="x", arch=arch)
        ptx_dir = tmp_path / f"ptx_{arch}"
        fn = get_compiled("ew", cfg, functools.partial(build_ew, ptx_dir=ptx_dir, counter=calls))
        st = cache_stats()[("ew", config_key(cfg))]
        assert st["source"] == "compile" and st["compiled_here"] and st["compile_s"] > 0
        assert type(fn).__name__.startswith("TVMFFIJitCompiledFunction")
        # PTX check
        (ptx,) = glob.glob(str(ptx_dir / f"*.{arch}.ptx"))
        assert f".target {arch}" in Path(ptx).read_text()
        # artifact published atomically: .o + .json, no temp files left
        obj = Path(st["path"])
        paths[arch] = obj
        assert obj.is_file() and obj.parent.parent.name == cache_fingerprint(arch)
        meta = json.loads(obj.with_suffix(".json").read_text())
        data = obj.read_bytes()
        assert meta["sha256"] == hashlib.sha256(data).hexdigest() and meta["arch"] == arch
        assert data[:4] == b"\x7fELF"
        assert not [p for p in _files(cache_dir) if ".tmp" in p.name]
    assert len(calls) == 2
    assert paths["sm_90a"].parent.parent != paths["sm_100a"].parent.parent  # fingerprint folder per arch

    # fresh in-memory state: the disk serves both, no rebuild
    clear_memory_cache()
    for arch in ("sm_90a", "sm_100a"):
        cfg = EwCfg(tag="x", arch=arch)
        fn = get_compiled("ew", cfg, functools.partial(build_ew, counter=calls))
        st = cache_stats()[("ew", config_key(cfg))]
        if _gpu_can_load(arch):
            assert st["source"] == "disk" and st["load_s"] is not None and st["load_s"] < 1.0
            assert st["compile_s"] > 0  # cold number kept for benchmarks
            assert callable(fn) and not type(fn).__name__.startswith("TVMFFIJitCompiledFunction")
        assert paths[arch].is_file()
    expected_builds = 2 + sum(not _gpu_can_load(a) for a in ("sm_90a", "sm_100a"))
    assert len(calls) == expected_builds


def test_disk_cache_corrupt_entries_rebuilt(cache_dir):
    pytest.importorskip("cutlass")
    cfg = EwCfg(tag="corrupt", arch="sm_90a")
    calls = []
    build = functools.partial(build_ew, counter=calls)
    get_compiled("ew", cfg, build)
    obj = Path(cache_stats()[("ew", config_key(cfg))]["path"])
    good = obj.read_bytes()
    meta_path = obj.with_suffix(".json")
    good_meta = meta_path.read_text()

    def refetch():
        clear_memory_cache()
        return get_compiled("ew", cfg, build)

    # 1. truncated object file -> checksum mismatch -> deleted, rebuilt, rewritten
    obj.write_bytes(good[: len(good) // 2])
    with pytest.warns(RuntimeWarning, match="deleting and rebuilding"):
        refetch()
    assert len(calls) == 2
    assert hashlib.sha256(obj.read_bytes()).hexdigest() == json.loads(meta_path.read_text())["sha256"]

    # 2. garbage sidecar
    meta_path.write_text("{not json")
    with pytest.warns(RuntimeWarning):
        refetch()
    assert len(calls) == 3 and json.loads(meta_path.read_text())["key"] == config_key(cfg)

    # 3. checksum-consistent garbage (loader error) -> rebuilt, never fatal
    junk = b"\x7fELF" + b"\0" * 60
    meta = json.loads(good_meta)
    meta.update(size=len(junk), sha256=hashlib.sha256(junk).hexdigest())
    obj.write_bytes(junk)
    meta_path.write_text(json.dumps(meta))
    with pytest.warns(RuntimeWarning, match="cannot load"):
        refetch()
    assert len(calls) == 4
    assert obj.read_bytes()[:4] == b"\x7fELF" and len(obj.read_bytes()) > 1000

    # after all that, a fresh state loads the rewritten artifact
    refetch()
    if _gpu_can_load("sm_90a"):
        assert cache_stats()[("ew", config_key(cfg))]["source"] == "disk"
        assert len(calls) == 4


def test_disk_cache_disabled_writes_nothing(cache_dir, monkeypatch):
    pytest.importorskip("cutlass")
    monkeypatch.setenv("CUTEDSL_ATTN_DISABLE_DISK_CACHE", "1")
    cfg = EwCfg(tag="disabled", arch="sm_100a")
    fn = get_compiled("ew", cfg, build_ew)
    assert callable(fn)
    st = cache_stats()[("ew", config_key(cfg))]
    assert st["source"] == "compile" and st["path"] is None
    assert _files(cache_dir) == []


def test_fingerprint_names_the_dsl_flavor(monkeypatch):
    """Kernels built by the DSL's CUDA 12 and CUDA 13 compilers (different ptxas) never share a disk entry."""
    pytest.importorskip("cutlass")
    import cutlass

    from cutedsl_attn.compile import dsl_cuda_flavor

    comps = cache_mod._fingerprint_components("sm_90a")
    assert comps["cutlass_dsl"] == f"{cutlass.__version__}+cu{dsl_cuda_flavor()}"
    fp = cache_fingerprint("sm_90a")
    monkeypatch.setattr(cache_mod, "_tool_versions", lambda: (f"{cutlass.__version__}+cu12", comps["tvm_ffi"]))
    assert cache_fingerprint("sm_90a") != fp or dsl_cuda_flavor() == 12


def test_disk_cache_unwritable_root_not_fatal(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("CUTEDSL_ATTN_CACHE_DIR", str(blocker / "sub"))  # parent is a file
    monkeypatch.delenv("CUTEDSL_ATTN_DISABLE_DISK_CACHE", raising=False)
    clear_memory_cache(reset_stats=True)
    monkeypatch.setattr(cache_mod, "_tool_versions", lambda: ("x", "y"))
    sentinel = object()
    with pytest.warns(RuntimeWarning, match="unusable"):
        assert get_compiled("fake", KeyCfg(), lambda c: sentinel) is sentinel
    clear_memory_cache(reset_stats=True)


def test_disk_cache_two_processes_compile_once(cache_dir):
    pytest.importorskip("cutlass")
    tag = f"conc{os.getpid()}"
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_REPO), str(here), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUTEDSL_ATTN_DISABLE_DISK_CACHE", None)
    # import under the same module name as pytest does, so config class names match
    code = f"import {Path(__file__).stem} as t; t._child_main({str(cache_dir)!r}, {tag!r})"
    cmd = [sys.executable, "-c", code]
    procs = [subprocess.Popen(cmd, env=env, cwd=str(_REPO), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
        results.append(json.loads(line[len("RESULT "):]))
    if _gpu_can_load("sm_90a"):
        assert sorted(r["source"] for r in results) == ["compile", "disk"]
    assert results[0]["key"] == results[1]["key"] == config_key(EwCfg(tag=tag, arch="sm_90a"))
    # keys with a closure-carrying score_mod are stable across processes
    assert results[0]["closure_key"] == results[1]["closure_key"] == _key_of_closure_cfg()
    objs = [p for p in _files(cache_dir) if p.suffix == ".o"]
    assert len(objs) == 1
