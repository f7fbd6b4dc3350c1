"""sm_100a variants on the serving side, without a Blackwell GPU: the runtime
refuses them on another arch, and the launch it would make on a B200 carries
the recorded cluster, PDL and shared-memory settings."""

import subprocess
import sys
from pathlib import Path

import pytest

from runtime import driver
from runtime import launch as launch_module
from runtime.artifact import read
from runtime.errors import DeviceRefused
from runtime.loader import select

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("mega-sm_100a-m1-float32", "grouped-sm_100a-m8-bfloat16-final")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("sm100") / "art"
    cmd = [sys.executable, "-m", "pipeline.cli", "compile", str(ROOT / "configs/glm5.yaml"),
           "-o", str(out), "--arch", "sm_100a", "--no-cache"]  # fmt: skip
    for v in VARIANTS:
        cmd += ["--variant", v]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    return read(out)


pytestmark = pytest.mark.compile


def test_refused_on_hopper(artifact):
    with pytest.raises(DeviceRefused, match="sm_90a") as info:
        select(artifact, "sm_90a")
    assert "sm_100a" in str(info.value)


class FakeDriver:
    """The few driver calls a Launcher makes, answered like a B200 would."""

    def __init__(self):
        self.attributes = {}
        self.launched = []

    def library_kernel(self, library, entry):
        return ("kernel", entry)

    def kernel_function(self, kernel, ordinal):
        return ("function", kernel[1])

    def function_attribute(self, function, name):
        return {"SHARED_SIZE_BYTES": 1024, "MAX_THREADS_PER_BLOCK": 1024}[name]

    def max_smem_optin(self, ordinal):
        return 232448

    def set_function_attribute(self, function, name, value):
        self.attributes[name] = value

    def max_active_clusters(self, function, config, ordinal):
        return 9

    def max_active_blocks(self, function, threads, smem, ordinal):
        return 1

    def sm_count(self, ordinal):
        return 148

    def launch(self, function, config, stream, params):
        self.launched.append((function, config, stream))

    launch_config = staticmethod(driver.launch_config)

    def attribute(self, ordinal, attr):
        return {"COOPERATIVE_LAUNCH": 1}[attr]


def _attributes(config) -> dict:
    out = {}
    for attr in config.attrs[: config.numAttrs]:
        ids = driver.cu.CUlaunchAttributeID
        if attr.id == ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION:
            out["pdl"] = attr.value.programmaticStreamSerializationAllowed
        elif attr.id == ids.CU_LAUNCH_ATTRIBUTE_COOPERATIVE:
            out["cooperative"] = attr.value.cooperative
        elif attr.id == ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION:
            c = attr.value.clusterDim
            out["cluster"] = (c.x, c.y, c.z)
    return out


@pytest.mark.parametrize("name", VARIANTS)
def test_launch_configuration_on_blackwell(artifact, name, monkeypatch):
    variant = {v.name: v for v in select(artifact, "sm_100a")}[name]
    fake = FakeDriver()
    monkeypatch.setattr(launch_module, "driver", fake)
    launcher = launch_module.Launcher(variant, None, 0, persistent=variant.kernel == "grouped")
    launcher(7, [0x1000 * (i + 1) for i in range(len(variant.params))])
    function, config, stream = fake.launched[0]
    assert stream == 7 and function == ("function", variant.entry)
    grid = (config.gridDimX, config.gridDimY, config.gridDimZ)
    assert grid == variant.launch.grid and config.sharedMemBytes == variant.launch.smem
    assert fake.attributes["MAX_DYNAMIC_SHARED_SIZE_BYTES"] == variant.launch.smem
    attrs = _attributes(config)
    assert attrs["pdl"] == 1
    if variant.kernel == "mega":
        # The sm_100a mega kernel's 16-CTA cluster per route: non-portable, so allowed explicitly.
        assert attrs["cluster"] == (16, 1, 1) == variant.launch.cluster
        assert fake.attributes["NON_PORTABLE_CLUSTER_SIZE_ALLOWED"] == 1
        assert grid == (16 * (8 + 1), 1, 1)  # 8 routes and the shared expert
        assert "cooperative" not in attrs
    else:
        # Its CTAs wait on each other: launched only with all of them resident.
        assert attrs["cooperative"] == 1
        # Persistent: one CTA per SM of the recorded B200 SM count, no cluster.
        assert "cluster" not in attrs and grid == (148, 1, 1) == (variant.sms, 1, 1)
        assert "NON_PORTABLE_CLUSTER_SIZE_ALLOWED" not in fake.attributes
