"""On the GPU: what F.scaled_dot_product_attention returns for a query whose keys are all
blocked, per dtype, input rank and backend; and what tfcore's fast path returns."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tfcore

print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      torch.cuda.get_device_name())
B, H, L, d = 2, 4, 8, 64
backends = [None, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def describe(row):
    if torch.isnan(row).any():
        return "NaN"
    return "zeros" if (row == 0).all() else f"non-zero (max |x| {row.abs().max().item():.3g})"


for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for rank in (4, 3):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, H, L, d, generator=g) for _ in range(3))
        mask = torch.ones(B, 1, L, L, dtype=torch.bool)
        mask[0, :, 3, :] = False  # query 3 of sequence 0 may attend to nothing
        if rank == 3:
            q, k, v = (t.flatten(0, 1) for t in (q, k, v))
            mask = mask.expand(B, H, L, L).flatten(0, 1)
        q, k, v = (t.to("cuda", dtype) for t in (q, k, v))
        mask = mask.cuda()
        cells = []
        for backend in backends:
            try:
                if backend is None:
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                else:
                    with sdpa_kernel([backend]):
                        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                row = out[0, :, 3] if rank == 4 else out[:H, 3]
                cells.append(f"{'default' if backend is None else backend.name}: {describe(row)}")
            except RuntimeError as error:
                cells.append(f"{backend.name}: refused ({str(error).splitlines()[0][:60]})")
        out, _ = tfcore.scaled_dot_product_attention(q, k, v, mask, need_weights=False)
        row = out[0, :, 3] if rank == 4 else out[:H, 3]
        cells.append(f"tfcore fast path: {describe(row)}")
        print(f"{str(dtype):15} {rank}-D | " + " | ".join(cells))
