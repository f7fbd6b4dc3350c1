// Streaming floor by cluster shape: G clusters of C CTAs, each CTA streaming
// KiB kibibytes of its own HBM with 1D bulk copies (cp.async.bulk) through an
// S-stage ring of 16 KiB, one issuing lane, the buffers rotated over up to
// 4 GiB so L2 holds none of them. Prints, per configuration, the median
// launch time (events around one launch, so launch overhead included), the
// in-kernel span (first CTA start to each cluster's last CTA end: min,
// median, max over the clusters) and, per cluster, its end time and SMs.
// The mega kernel's grids are this shape: one cluster per route.
//
// With GRAPH set to 1 it also times what `moe-build bench` times: a CUDA
// graph of 8 launches (each with programmatic stream serialization, as the
// runtime launches the kernels, each CTA waiting on `griddepcontrol.wait`
// first and issuing no early trigger), each on its own buffer, replayed
// `reps` times; it prints the median per launch, so the gap between one
// launch's last CTA and the next one's first is in it.
//
//   nvcc -O2 -arch=sm_90a -o cluster_stream benchmarks/cluster_stream.cu
//   ./cluster_stream G C S KiB [reps] [GRAPH] [ALIAS] [SMEM_KIB]
//     # e.g. 9 8 10 768: GLM-5 at M = 1
//
// ALIAS (default 0): clusters 0..ALIAS-1 all stream cluster 0's bytes (the
// mega kernel's one shared-expert cluster per token at M = ALIAS). SMEM_KIB:
// dynamic shared memory a CTA reserves (at least the ring), to hold the CTAs
// per SM at a kernel's (e.g. 60 for 3 a SM).
//
// Results and what they showed: docs/notes/mega-sm90.md, "Cluster size and
// GPC balance".
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
#include <cstdint>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); exit(1);} } while (0)

__device__ __forceinline__ uint64_t gtimer() {
  uint64_t t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ uint32_t smid() {
  uint32_t s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s;
}

extern "C" __global__ void stream(const uint8_t* src, size_t per_cta, int stages,
                                  unsigned long long* stamps, int record, int csize,
                                  int alias) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[32];
  const int chunk = 16384;
  uint64_t t0 = gtimer();
  // Returns at once without a programmatic dependency (the single launches).
  asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      uint32_t b = (uint32_t)__cvta_generic_to_shared(&bars[s]);
      asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(b));
    }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    // Clusters 0..alias-1 all read cluster 0's bytes (as the mega kernel's M
    // shared-expert clusters read one expert's weights).
    int cta = (int)blockIdx.x;
    if (cta / csize < alias) cta %= csize;
    const uint8_t* base = src + (size_t)cta * per_cta;
    int n = (int)(per_cta / chunk);
    for (int i = 0; i < n; ++i) {
      int slot = i % stages;
      uint32_t b = (uint32_t)__cvta_generic_to_shared(&bars[slot]);
      if (i >= stages) {
        uint32_t parity = ((i / stages) - 1) & 1;
        asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n"
                     " @!p bra W;\n}" :: "r"(b), "r"(parity));
      }
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(b), "r"(chunk));
      uint32_t dst = (uint32_t)__cvta_generic_to_shared(smem + (size_t)slot * chunk);
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(dst), "l"(base + (size_t)i * chunk), "r"(chunk), "r"(b) : "memory");
    }
    for (int i = (n > stages ? n - stages : 0); i < n; ++i) {
      int slot = i % stages;
      uint32_t b = (uint32_t)__cvta_generic_to_shared(&bars[slot]);
      uint32_t parity = (i / stages) & 1;
      asm volatile("{\n .reg .pred p;\n W2: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;\n"
                   " @!p bra W2;\n}" :: "r"(b), "r"(parity));
    }
    if (record) {
      uint32_t cid; asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cid));
      stamps[blockIdx.x * 4 + 0] = t0;
      stamps[blockIdx.x * 4 + 1] = gtimer();
      stamps[blockIdx.x * 4 + 2] = smid();
      stamps[blockIdx.x * 4 + 3] = cid;
    }
  }
}

int main(int argc, char** argv) {
  // args: clusters cluster_size stages bytes_per_cta_kib [reps] [graph]
  if (argc < 5) { printf("usage: clusters csize stages kib [reps] [graph]\n"); return 1; }
  int G = atoi(argv[1]), C = atoi(argv[2]), S = atoi(argv[3]);
  size_t per = (size_t)atoi(argv[4]) * 1024;
  int reps = argc > 5 ? atoi(argv[5]) : 30;
  int graph = argc > 6 ? atoi(argv[6]) : 0;
  int alias = argc > 7 ? atoi(argv[7]) : 0;
  int smem_kib = argc > 8 ? atoi(argv[8]) : 0;
  int grid = G * C;
  size_t total = per * grid;
  size_t pool = ((size_t)4 << 30);  // 4 GiB: rotate so L2 holds nothing
  int copies = (int)std::max<size_t>(1, pool / total);
  if (copies > 64) copies = 64;
  uint8_t* buf; CK(cudaMalloc(&buf, total * copies));
  CK(cudaMemset(buf, 1, total * copies));
  unsigned long long* stamps; CK(cudaMalloc(&stamps, grid * 4 * sizeof(unsigned long long)));
  int smem = std::max(S * 16384, smem_kib * 1024);
  CK(cudaFuncSetAttribute(stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(stream, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid); cfg.blockDim = dim3(64); cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = C; attr[0].val.clusterDim.y = 1; attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr; cfg.numAttrs = 1;
  int active = 0;
  CK(cudaOccupancyMaxActiveClusters(&active, stream, &cfg));
  cudaStream_t st; CK(cudaStreamCreate(&st)); cfg.stream = st;
  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  std::vector<float> ts;
  for (int r = 0; r < reps + 5; ++r) {
    const uint8_t* src = buf + (size_t)(r % copies) * total;
    int rec = r == reps + 4;
    CK(cudaEventRecord(a, st));
    CK(cudaLaunchKernelEx(&cfg, stream, src, per, S, stamps, rec, C, alias));
    CK(cudaEventRecord(b, st));
    CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 5) ts.push_back(ms * 1000.f);
  }
  std::sort(ts.begin(), ts.end());
  float med = ts[ts.size() / 2];
  std::vector<unsigned long long> h(grid * 4);
  CK(cudaMemcpy(h.data(), stamps, h.size() * 8, cudaMemcpyDeviceToHost));
  unsigned long long t0 = ~0ull;
  for (int i = 0; i < grid; ++i) t0 = std::min(t0, h[i * 4]);
  // per cluster: end time (max over CTAs), the smids
  std::vector<double> ends(G, 0);
  for (int i = 0; i < grid; ++i) ends[i / C] = std::max(ends[i / C], (h[i * 4 + 1] - t0) / 1e3);
  double last = *std::max_element(ends.begin(), ends.end());
  std::vector<double> se = ends; std::sort(se.begin(), se.end());
  printf("RESULT G=%d C=%d S=%d KiB=%zu alias=%d grid=%d resident_clusters=%d MB=%.1f median_us=%.2f TB/s=%.3f "
         "cluster_end_us min=%.2f med=%.2f max=%.2f\n", G, C, S, per / 1024, alias, grid, active,
         total / 1e6, med, total / (med * 1e-6) / 1e12, se[0], se[G / 2], last);
  if (graph) {
    // 8 launches a graph, as the bench's graphs of 8 calls (one buffer each).
    const int calls = 8;
    cudaLaunchAttribute gattr[2];
    gattr[0] = attr[0];
    gattr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    gattr[1].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t gcfg = cfg;
    gcfg.attrs = gattr; gcfg.numAttrs = 2;
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int c = 0; c < calls; ++c) {
      const uint8_t* src = buf + (size_t)(c % copies) * total;
      CK(cudaLaunchKernelEx(&gcfg, stream, src, per, S, stamps, 0, C, alias));
    }
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    std::vector<float> gt;
    for (int r = 0; r < reps + 5; ++r) {
      CK(cudaEventRecord(a, st));
      CK(cudaGraphLaunch(ge, st));
      CK(cudaEventRecord(b, st));
      CK(cudaEventSynchronize(b));
      float ms; CK(cudaEventElapsedTime(&ms, a, b));
      if (r >= 5) gt.push_back(ms * 1000.f / calls);
    }
    std::sort(gt.begin(), gt.end());
    printf("GRAPH G=%d C=%d S=%d KiB=%zu alias=%d per_launch_us=%.2f (min %.2f) TB/s=%.3f\n", G, C, S,
           per / 1024, alias, gt[gt.size() / 2], gt[0], total / (gt[gt.size() / 2] * 1e-6) / 1e12);
  }
  printf("CLUSTERS");
  for (int g = 0; g < G; ++g) {
    printf(" [%d:%.1f:", g, ends[g]);
    for (int c = 0; c < C; ++c) printf("%s%llu", c ? "," : "", h[(g * C + c) * 4 + 2]);
    printf("]");
  }
  printf("\n");
  return 0;
}
