"""PyTorch's scaled_dot_product_attention on the attention shapes of `cargo xtask bench
kernels --reference pytorch`, for its SDPA columns (the GPU-speed issue: ember's attention at
seq 512 no slower than PyTorch's SDPA in the same run).

Reads a JSON file of shapes ({"name", "batch", "heads", "seq", "head_dim", "scale"}) and prints
one JSON line: {"forward_s": [...], "forward_backward_s": [...], "device", "torch"}, seconds
per call in the shapes' order. Each shape is what ember's attention op gets: q, k, v
[batch, heads, seq, head_dim] drawn from N(0, 1), an additive key mask [batch, 1, 1, seq] of
-10000 on the last quarter of every other sample (BERT's padding), the scale, dropout
`--dropout` on the probabilities; `F.scaled_dot_product_attention` as Hugging Face's BERT
calls it with `attn_implementation="sdpa"` (a float mask rules out the flash kernel; PyTorch
picks among those that take one, memory-efficient or cuDNN, as it does for BERT). Forward and backward: the output's gradient all ones, as Burn's
`backward()` of a tensor seeds it. Timed as ember's: one warm-up call, then the mean of
`--iters` calls between two synchronisations.
"""

import argparse
import json
import time

import torch
import torch.nn.functional as F


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with open(args.shapes) as f:
        shapes = json.load(f)

    def timed(call):
        call()
        sync()
        start = time.perf_counter()
        for _ in range(args.iters):
            call()
        sync()
        return (time.perf_counter() - start) / args.iters

    forward, forward_backward = [], []
    for s in shapes:
        b, nh, n, hd = s["batch"], s["heads"], s["seq"], s["head_dim"]
        q, k, v = (torch.randn(b, nh, n, hd, dtype=dtype, device=device) for _ in range(3))
        mask = torch.zeros(b, 1, 1, n, dtype=dtype, device=device)
        mask[1::2, :, :, 3 * n // 4 :] = -10000.0

        def attend(q, k, v):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=args.dropout, scale=s["scale"]
            )

        with torch.no_grad():
            forward.append(timed(lambda: attend(q, k, v)))
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))

        def step():
            # Fresh gradients each call, as Burn's backward() returns (no accumulation).
            qa.grad = ka.grad = va.grad = None
            out = attend(qa, ka, va)
            out.backward(torch.ones_like(out))

        forward_backward.append(timed(step))
        del q, k, v, qa, ka, va, mask
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        json.dumps(
            {
                "forward_s": forward,
                "forward_backward_s": forward_backward,
                "device": name,
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
