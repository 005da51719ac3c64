"""The compiler toolchain the PTX and SASS assertions of this suite were measured with: the CuTe DSL's CUDA 13
build (``nvidia-cutlass-dsl[cu13]``).  A plain ``nvidia-cutlass-dsl`` install brings only the CUDA 12 build, whose
ptxas schedules some kernels differently; ``pip install -e ".[test]"`` installs the CUDA 13 one.

CPU only: the tiny kernel below is cross-compiled for sm_90a.
"""

import glob
import importlib.metadata as md
import re
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from cutedsl_attn.compile import compile_options, dsl_cuda_flavor  # noqa: E402

EXPECTED_CUDA_MAJOR = 13
_INSTALL_HINT = 'install the test set-up: pip install -e ".[test]" (it pulls nvidia-cutlass-dsl[cu13])'


def test_dsl_cuda13_libs_installed_and_loaded():
    dsl = md.version("nvidia-cutlass-dsl")
    try:
        cu13 = md.version("nvidia-cutlass-dsl-libs-cu13")
    except md.PackageNotFoundError:
        raise AssertionError(f"nvidia-cutlass-dsl-libs-cu13 is not installed; {_INSTALL_HINT}") from None
    assert cu13 == dsl, f"nvidia-cutlass-dsl {dsl} with nvidia-cutlass-dsl-libs-cu13 {cu13}: versions must match"
    # the DSL loads the newest flavor the driver supports: the cu13 one here (no driver, or a CUDA 13 driver)
    assert dsl_cuda_flavor() == EXPECTED_CUDA_MAJOR, f"the DSL loaded its cu{dsl_cuda_flavor()} compiler; {_INSTALL_HINT}"


def _tiny_ptx(tmp_path) -> str:
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    @cute.kernel
    def add_one(x: cute.Tensor, n: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < n:
            x[tidx] = x[tidx] + 1.0

    @cute.jit
    def launch(x: cute.Tensor, stream):
        add_one(x, cute.size(x, mode=[0])).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    fx = make_fake_compact_tensor(cutlass.Float32, (cute.sym_int(),), assumed_align=16)
    cute.compile(launch, fx, make_fake_stream(use_tvm_ffi_env_stream=True),
                 options=compile_options("sm_90a", keep_ptx_dir=tmp_path))
    (path,) = glob.glob(str(tmp_path / "*.ptx"))
    return Path(path).read_text()


def test_ptx_header_names_cuda13_tools(tmp_path):
    text = _tiny_ptx(tmp_path)
    header = text[: text.index(".version")]
    m = re.search(r"Cuda compilation tools, release (\d+)\.(\d+)", header)
    assert m, f"no 'Cuda compilation tools' line in the PTX header:\n{header}"
    assert int(m.group(1)) == EXPECTED_CUDA_MAJOR, f"PTX made by CUDA {m.group(1)}.{m.group(2)} tools; {_INSTALL_HINT}"
    assert ".target sm_90a" in text
