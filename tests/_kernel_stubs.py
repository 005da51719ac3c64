"""Stand-ins for the dispatch layer's compiled kernels, shared by the CPU API tests (decode and prefill).

``Recorder(arg_names)`` replaces ``dispatch.paged_decode_kernel`` / ``dispatch.prefill_kernel``: it records
each requested config and each launch (checking the argument count against ``arg_names(cfg)``) and writes
recognisable values into ``o`` (1.0) and ``lse`` (0.5) so the wrappers' output handling can be checked.
``EntryRejects(arg_index, pname, signature)`` is a kernel whose tvm-ffi entry rejects one argument with
the entry's own message format.
"""

from __future__ import annotations


class Recorder:
    """Records configs and launches of a stubbed kernel family."""

    def __init__(self, arg_names):
        self.arg_names = arg_names  # cfg -> the kernel's argument names, in order
        self.cfgs = []
        self.calls = []

    def __call__(self, cfg):
        self.cfgs.append(cfg)

        def launch(*args):
            assert len(args) == len(self.arg_names(cfg))
            self.calls.append((cfg, args))
            args[5].fill_(1.0)  # o
            args[6].fill_(0.5)  # lse

        return launch

    def named(self, i):
        cfg, a = self.calls[i]
        return cfg, dict(zip(self.arg_names(cfg), a))

    @property
    def last(self):
        return self.named(-1)


class EntryRejects:
    """A kernel whose tvm-ffi entry rejects argument ``arg_index`` (named ``pname`` in the kernel signature
    ``signature``), with the entry's own message format; ``msg`` may be replaced by a test."""

    def __init__(self, arg_index, pname, signature):
        self.msg = (f"Mismatched {pname}.strides[2] on argument #{arg_index} when calling: "
                    f"`__call__({signature}, ...)`, expected 1")

    def __call__(self, cfg):
        def launch(*args):
            raise ValueError(self.msg)

        return launch
