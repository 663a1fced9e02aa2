import torch, time
a = torch.randn(576, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(14336 * 2, 4096, device="cuda", dtype=torch.bfloat16)
def t(fn, n=50):
    for _ in range(5): fn()
    torch.cuda.synchronize(); s = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - s) / n * 1e3
for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    for c in (None, 32, 66, None):
        torch._C._set_sm_carveout_experimental(c)
        print(lib, "carveout", c, "mm 576x4096x28672 %.3f ms" % t(lambda: a @ b.t()))
torch._C._set_sm_carveout_experimental(None)
