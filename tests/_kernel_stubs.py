"""Stand-ins for the compiled kernels behind ``dispatch.KernelChoice``, shared by the CPU API tests.

The seam: ``dispatch.get_compiled`` (what ``KernelChoice.fn`` compiles through) returns a stub callable, and
each kernel module's ``launch`` is wrapped.  The real ``launch`` still runs (it orders the arguments for the
stub), so the tests see what dispatch and the kernel module hand over.

``Recorder`` records each compiled configuration (``cfgs``, as :class:`Launched`) and each launch (``calls``: ``(name, cfg, args)``,
``args`` the family's ``PrefillArgs`` / ``DecodeArgs``) and writes recognisable values: ``out`` =
``args.output_scale`` (a kernel whose normalised O is 1 applies the output scale in fp32), ``lse`` = 0.5.
``EntryRejects(arg_index, pname, signature)`` is a compiled kernel whose tvm-ffi entry rejects argument
``arg_index`` (the kernel's own position) with the entry's message format.
"""

from __future__ import annotations

from cutedsl_attn import dispatch


class Launched:
    """The choice of one recorded launch: ``name`` (the kernel's ``NAME``), ``cfg``, and the problem's, tiles' and
    config's attributes by name (``.causal``, ``.tile_n``, ``.tile_m``)."""

    def __init__(self, name, cfg):
        self.name, self.cfg = name, cfg

    def __eq__(self, other):
        return isinstance(other, Launched) and (self.name, self.cfg) == (other.name, other.cfg)

    def __hash__(self):
        return hash((self.name, self.cfg))

    def __getattr__(self, attr):
        for o in (self.cfg.problem, self.cfg.tiles, self.cfg):
            if hasattr(o, attr):
                return getattr(o, attr)
        raise AttributeError(attr)


class _StubKernel:
    """What ``get_compiled`` returns under a stub: records how many positional arguments each call passed."""

    def __init__(self, name, cfg, sink):
        self.name, self.cfg, self.sink = name, cfg, sink

    def __call__(self, *positional):
        self.sink.append(len(positional))


def _fresh_registries(monkeypatch):
    """The choices dispatch keeps (shared by plans of one shape, found by the custom ops) start empty and are
    restored after the test: no choice outlives it with a stub as its compiled kernel."""
    monkeypatch.setattr(dispatch, "_CHOICES", {})
    monkeypatch.setattr(dispatch, "_BY_KEY", {})


class Recorder:
    """Records compiles and launches of every kernel module (install with :meth:`install`)."""

    def __init__(self):
        self.cfgs = []
        self.calls = []
        self.positional = []

    def install(self, monkeypatch):
        _fresh_registries(monkeypatch)
        monkeypatch.setattr(dispatch, "get_compiled", self._get_compiled)
        for name, m in dispatch.KERNEL_MODULES.items():
            monkeypatch.setattr(m, "launch", self._launch(name, m.launch))
        return self

    def _get_compiled(self, name, cfg, build):
        self.cfgs.append(Launched(name, cfg))
        return _StubKernel(name, cfg, self.positional)

    def _launch(self, name, real):
        def launch(fn, cfg, args):
            real(fn, cfg, args)  # the module's own argument order, into the stub
            self.calls.append((name, cfg, args))
            args.out.fill_(args.output_scale)
            args.lse.fill_(0.5)

        return launch

    def named(self, i):
        name, cfg, args = self.calls[i]
        return Launched(name, cfg), args._asdict()

    @property
    def last(self):
        return self.named(-1)


class _Raising:
    def __init__(self, msg_holder):
        self.holder = msg_holder

    def __call__(self, *a):
        raise ValueError(self.holder.msg)


class EntryRejects:
    """A compiled kernel whose tvm-ffi entry rejects argument ``arg_index`` (named ``pname`` in the kernel signature
    ``signature``), with the entry's own message format; ``msg`` may be replaced by a test."""

    def __init__(self, arg_index, pname, signature):
        self.msg = (f"Mismatched {pname}.strides[2] on argument #{arg_index} when calling: "
                    f"`__call__({signature}, ...)`, expected 1")

    def install(self, monkeypatch):
        _fresh_registries(monkeypatch)
        monkeypatch.setattr(dispatch, "get_compiled", lambda name, cfg, build: _Raising(self))
        return self


# ----------------------------------------------------------------------------- bad paged caches
# The decode and prefill wrappers share one paged-cache check (``api._common.paged_kv_views``); both CPU API
# test files run these cases against it through their own wrapper.
BAD_PAGED_CACHE_SHAPES = ("page_size", "heads", "dim", "layout", "4d_combined")


def bad_paged_cache(cache, what):
    """A wrong form of the planned NHD 5-D cache ``[pages, 2, page_size=16, Hkv=2, D=64]``: ``what`` in
    :data:`BAD_PAGED_CACHE_SHAPES`; every one must raise ``ValueError`` naming the cache."""
    import torch

    return {
        "page_size": cache[:, :, :8],
        "heads": cache[:, :, :, :1],
        "dim": torch.zeros(cache.shape[0], 2, 16, 2, 32, dtype=cache.dtype),
        "layout": cache.transpose(2, 3),  # HND cache handed to an NHD wrapper
        "4d_combined": cache[:, :, 0],
    }[what]


def bad_cache_tuples(k, v):
    """``(exception, message pattern, cache)``: wrong ``(k_cache, v_cache)`` tuples (arity, type, shape, dtype)."""
    import torch

    return [
        (ValueError, "paged_kv_cache", (k, v, v)),
        (TypeError, "k_cache", (k.tolist(), v)),
        (ValueError, "v_cache", (k, v[:, :8])),
        (ValueError, "k_cache", (k.to(torch.float16), v)),
        (ValueError, "v_cache", (k, v.to(torch.float16))),
    ]
