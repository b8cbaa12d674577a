"""attnkit._C exports no kernel. The kernels are compiled with hidden visibility
(CMakeLists.txt, attnkit_add_isa_objects): exported, their tile tables were process-wide
unique objects (STB_GNU_UNIQUE), so a second attnkit build loaded in the same process (an
extension linking libattnkit.a next to attnkit._C) ran the first build's micro-kernels."""
import ctypes

import attnkit


def test_kernels_are_not_exported():
    lib = ctypes.CDLL(attnkit._C.__file__)
    assert hasattr(lib, "PyInit__C")  # the lookup itself works
    # attnkit::cpu::generic::sage_int8_fwd(attnkit::AttentionParams const&, bool), a kernel entry
    assert not hasattr(lib, "_ZN7attnkit3cpu7generic13sage_int8_fwdERKNS_15AttentionParamsEb")
    # attnkit::cpu::generic::TileTable<GemmKernel, 4, 3>::table, a tile table
    assert not hasattr(lib, "_ZN7attnkit3cpu7generic9TileTableINS1_10GemmKernelELi4ELi3EE5tableE")
