"""Architecture and format constants: the one definition of each, for the
kernels, the pipeline and the runtime alike.

A leaf module: it imports nothing (no torch, no cutlass, nothing of this
project), so every layer can import it without an import circle, and the
runtime still imports nothing of ``kernels/``.
"""

from __future__ import annotations

#: K blocks, block-scale blocks and row tiles of every kernel (elements).
TILE = 128
#: Largest finite float8_e4m3fn.
FP8_MAX = 448.0
#: Largest token count M any kernel serves (grouped plan, workspace sizes,
#: the layer's dispatch table). The configs' grouped buckets reach it (all
#: but Kimi-K2 TP8, whose 384 experts' unit tables leave sm_90a too little
#: shared memory for a 512-token ring: 448): one call of up to 512 tokens
#: reads each expert once, where chunks of 256 read it once per chunk. 512
#: is also the most the grouped kernel's tables take as they are: the shared
#: expert's units, 16 tokens each on sm_100a, are one a lane of a warp
#: (``kernels.grouped_plan.plan_problems``).
MAX_TOKENS = 512

#: The i32 kernel parameter holding the rows of x and logits a call passes
#: (the grouped kernel's last; ``kernels.abi.SCALAR_PARAMS``,
#: ``runtime.moe.takes_valid``).
VALID = "valid"

#: The kernels an artifact can hold, and the archs they are built for.
KERNELS = ("mega", "grouped")
ARCHS = ("sm_90a", "sm_100a")
LOGITS_DTYPES = ("float32", "bfloat16")
#: Compute capability -> the arch of the cubins that run there.
ARCH_OF = {(9, 0): "sm_90a", (10, 0): "sm_100a"}

#: Dynamic shared memory one CTA may use, per target: the per-block opt-in
#: (cudaDevAttrMaxSharedMemoryPerBlockOptin: 232448 B = 227 KiB on H100/H200
#: and B200) less the 1 KiB the cubin reports as static for any kernel using
#: shared memory. Kernels plan against these recorded values; the runtime
#: checks the device's own limit at bind.
SMEM_OPTIN = {"sm_90a": 232448, "sm_100a": 232448}
SMEM_RESERVED = 1024
SMEM_LIMIT = {arch: optin - SMEM_RESERVED for arch, optin in SMEM_OPTIN.items()}
#: Shared memory of one SM (cudaDevAttrMaxSharedMemoryPerMultiprocessor:
#: 233472 B = 228 KiB on H100/H200 and B200), which the CTAs resident on it
#: share, each with SMEM_RESERVED more.
SMEM_PER_SM = {"sm_90a": 233472, "sm_100a": 233472}
#: Clusters a target holds at once, recorded per (arch, SM count): cluster
#: size -> resident clusters at 1, 2, 3 CTAs per SM (a shorter list: not
#: measured past its end). Clusters live inside one GPC, so a target holds
#: fewer than its SM count over the cluster size; how many is the
#: device's, read with cuOccupancyMaxActiveClusters (the runtime's
#: ``Launcher.residency``; ``moe-build bench`` records it per variant).
#: Measured on an H200 (132 SMs, driver 580.159.04) for CTAs of 160 (the
#: mega kernel's) and 192 threads at the shared memory of each CTAs-per-SM level
#: (docs/notes/h200-measurements.md, docs/notes/models-h200.md; the
#: committed bench results' ``residency`` records must agree:
#: tests/test_recorded_residency.py). A target or
#: entry not recorded here is planned with the bound (``kernels/mega_plan.py``
#: ``resident_clusters``).
RESIDENT_CLUSTERS = {
    ("sm_90a", 132): {
        2: (66, 132),
        4: (30, 62),
        6: (17, 39),
        8: (15, 30, 45),
        12: (7, 16, 28),
        16: (7, 14),
    },
}
