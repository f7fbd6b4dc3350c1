"""runtime.loader's device-independent refusals, runtime.tensormap's geometry,
and the rule that the runtime never imports cutlass."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import runtime_fixtures as fx

from runtime.artifact import read
from runtime.errors import DeviceRefused
from runtime.loader import arch_of, check_driver, model_shape, select
from runtime.tensormap import geometry


def test_arch_of_capability():
    assert arch_of((9, 0)) == "sm_90a"
    assert arch_of((10, 0)) == "sm_100a"
    with pytest.raises(DeviceRefused, match=r"compute capability 8.9: no arch .* sm_90a"):
        arch_of((8, 9))


def test_select_and_driver_refusals(tmp_path):
    data = read(fx.write(tmp_path, [(fx.record("mega"), fx.cubin("a"))], min_driver=13000))
    assert [v.name for v in select(data, "sm_90a")] == ["mega-sm_90a-m1-float32"]
    with pytest.raises(DeviceRefused, match=r"no variant for sm_100a .* it holds sm_90a"):
        select(data, "sm_100a")
    check_driver(data, 13000)
    with pytest.raises(
        DeviceRefused, match=r">= 13000 \(manifest min_driver\); this driver is 12080"
    ):
        check_driver(data, 12080)
    assert model_shape(data).top_k == fx.SMALL_MODEL["top_k"]


def test_tensor_map_geometry_follows_format():
    # glm5 w13: [E=288, H/128=32, 2I=1024, 128]
    g = geometry((288, 32, 1024, 128))
    assert g.dims == (128, 1024, 288 * 32)
    assert g.strides == (128, 1024 * 128)
    assert g.box == (128, 128, 1) and g.element_strides == (1, 1, 1)
    assert geometry((1, 4, 4096, 128)).dims == (128, 4096, 4)
    with pytest.raises(ValueError, match="expected"):
        geometry((288, 32, 1024))
    with pytest.raises(ValueError, match="multiple of 128"):
        geometry((1, 4, 100, 128))


def test_runtime_never_imports_cutlass(tmp_path):
    """A fresh interpreter reads an artifact and builds a layer's plan with the
    runtime; no cutlass module appears (the venv's .pth imports the
    nvidia_cutlass_dsl path shim at startup, before any of this runs)."""
    root = fx.write(tmp_path / "a", [(fx.record("mega"), fx.cubin("a"))])
    code = textwrap.dedent(f"""
        import sys
        before = {{m for m in sys.modules if "cutlass" in m}}
        import runtime, runtime.loader, runtime.moe, runtime.launch, runtime.driver
        import runtime.tensormap, runtime.workspace, runtime.graphs, runtime.inputs
        from runtime.artifact import read
        from runtime.plan import default_table
        data = read({str(root)!r})
        assert default_table({{"mega": {{1: {{False}}}}}})
        new = sorted(m for m in sys.modules if "cutlass" in m and m not in before)
        top = sorted(m for m in sys.modules if m.split(".")[0] in ("cutlass", "cute"))
        print(new, top)
        sys.exit(1 if new or top else 0)
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
