"""torch.matmul on the GEMMs of `cargo xtask bench gemm`, for its reference column.

Reads a JSON file of GEMMs ({"name", "batch", "m", "k", "n", "trans_a", "trans_b"}: a is
[batch, m, k] and b [batch, k, n], each built transposed in memory and viewed back when its
flag is set, as ember's operands are) and prints one JSON line: {"tflops": {dtype: [TFLOP/s
per GEMM]}, "tf32": bool, "device": name}. Each GEMM is timed as ember's: one warm-up, then the
mean of `--iters` products between two synchronisations. f32 follows PyTorch's default
(`torch.backends.cuda.matmul.allow_tf32`, False unless `--tf32`).
"""

import argparse
import json
import time

import torch


def operand(batch, rows, cols, transposed, dtype, device):
    if transposed:
        return torch.randn(batch, cols, rows, dtype=dtype, device=device).transpose(1, 2)
    return torch.randn(batch, rows, cols, dtype=dtype, device=device)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gemms", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtypes", default="f32,bf16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--tf32", action="store_true")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with open(args.gemms) as f:
        gemms = json.load(f)
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
    result = {}
    for name in args.dtypes.split(","):
        dtype = dtypes[name]
        rates = []
        for g in gemms:
            a = operand(g["batch"], g["m"], g["k"], g["trans_a"], dtype, device)
            b = operand(g["batch"], g["k"], g["n"], g["trans_b"], dtype, device)
            torch.matmul(a, b)
            sync()
            start = time.perf_counter()
            for _ in range(args.iters):
                torch.matmul(a, b)
            sync()
            seconds = (time.perf_counter() - start) / args.iters
            rates.append(2 * g["batch"] * g["m"] * g["k"] * g["n"] / seconds / 1e12)
        result[name] = rates
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(json.dumps({"tflops": result, "tf32": args.tf32, "device": name}), flush=True)


if __name__ == "__main__":
    main()
