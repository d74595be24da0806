#!/usr/bin/env python3
"""The PyTorch reference of `cargo xtask bench train-step`: Hugging Face `BertForPreTraining`
trained with `torch.optim.AdamW` on the batch and weights that ember exported.

Precision (`--precision`): f32, or `torch.autocast` to bf16 or fp16 around the forward and the
losses (PyTorch's mixed precision: f32 parameters and optimizer, a cast per op; ember's Note
[Autocast] follows it, except that torch.autocast returns LayerNorm's output in f32 where
ember keeps it in the half type). No loss scaling on either side: the benchmark times steps from
a random initialisation, whose gradients fp16 holds; the trainer's fp16 scales the loss.
On CUDA the optimizer is AdamW's fused kernel (`fused=True`: multi-tensor launches, what
NVIDIA's and apex's recipes use); on the CPU its default (a loop over the tensors).

The step is the one NVIDIA's MLPerf BERT and ember take: the encoder over the whole batch, the
masked-LM head only at the masked positions (`cls.predictions` over the gathered hidden states,
as NVIDIA's `BertForPreTraining` with `masked_lm_positions`), the next-sentence head on the
pooled output; loss = mean masked-LM cross-entropy + mean next-sentence cross-entropy; backward;
AdamW with weight decay on every parameter but biases and LayerNorm (ember's groups,
`trainer/src/optim.rs`, `uses_weight_decay`).

Run by the harness as a server, one JSON object per line each way (stdin -> stdout):
  {"cmd": "loss"}                 -> {"loss", "mlm_loss", "nsp_loss"}   (forward, no update)
  {"cmd": "steps", "n": N}        -> {"seconds": [N], "losses": [N], "reserved_bytes"}
                                     (N training steps; reserved_bytes: the CUDA caching
                                     allocator's peak, torch.cuda.max_memory_reserved; null on
                                     the CPU)
  {"cmd": "gemm", "n": S, "reps": R, "dtype": "f32"|"bf16"|"fp16"} -> {"gflops"}
                                     ([S,S] x [S,S] in that dtype, best of R)
  {"cmd": "fits", "batch": N}     -> {"fits", "reserved_bytes"}
                                     (two eager steps at N sequences, the batch's tiled;
                                     false when CUDA ran out of memory: `bench train-step
                                     --largest-batch`)
  {"cmd": "quit"}
On start it prints {"ready": true, ...} with the versions, thread count and parameter count.

Inputs: --model DIR (config.json + model.safetensors under Hugging Face's names, dropout 0),
--batch FILE (safetensors: input_ids, token_type_ids, attention_mask [B, S];
masked_lm_positions, masked_lm_ids [B, P]; masked_lm_weights [B, P] (1 = real prediction);
next_sentence_labels [B]). Needs: torch, transformers, safetensors (`cargo xtask bench
--setup-reference` installs them into bench/reference/.venv).
"""
import argparse
import contextlib
import gc
import json
import sys
import time

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file
from transformers import BertForPreTraining


DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--beta1", type=float, required=True)
    parser.add_argument("--beta2", type=float, required=True)
    parser.add_argument("--eps", type=float, required=True)
    parser.add_argument("--weight-decay", type=float, required=True)
    parser.add_argument("--compile", action="store_true", help="torch.compile the step's model")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--precision", default="f32", choices=sorted(DTYPES))
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = BertForPreTraining.from_pretrained(args.model).to(device)
    model.train()  # dropout probabilities are 0 in the exported config: train mode changes nothing
    batch = {k: v.to(device) for k, v in load_file(args.batch).items()}

    def inputs(rows):
        """The batch's tensors as the step reads them, its sequences tiled to `rows`."""
        def tiled(t, long=True):
            t = t.long() if long else t
            return t.repeat((-(-rows // t.shape[0]),) + (1,) * (t.dim() - 1))[:rows]

        input_ids = tiled(batch["input_ids"])
        b, s = input_ids.shape
        real = tiled(batch["masked_lm_weights"], long=False) > 0
        offsets = torch.arange(b, device=device).unsqueeze(1) * s
        return {
            "input_ids": input_ids,
            "token_type_ids": tiled(batch["token_type_ids"]),
            "attention_mask": tiled(batch["attention_mask"]),
            "flat": (tiled(batch["masked_lm_positions"]) + offsets)[real],
            "labels": tiled(batch["masked_lm_ids"])[real],
            "nsp_labels": tiled(batch["next_sentence_labels"]),
        }

    given = inputs(batch["input_ids"].shape[0])

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if ("bias" in name or "LayerNorm" in name) else decay).append(param)
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
        fused=fused,
    )
    hidden = model.config.hidden_size
    dtype = DTYPES[args.precision]

    def autocast():
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def losses(x):
        with autocast():
            out = model.bert(
                input_ids=x["input_ids"],
                attention_mask=x["attention_mask"],
                token_type_ids=x["token_type_ids"],
            )
            sequence_output, pooled = out[0], out[1]
            masked = sequence_output.reshape(-1, hidden).index_select(0, x["flat"])
            mlm = F.cross_entropy(model.cls.predictions(masked).float(), x["labels"])
            nsp = F.cross_entropy(model.cls.seq_relationship(pooled).float(), x["nsp_labels"])
        return mlm, nsp

    step_losses = torch.compile(losses) if args.compile else losses

    def fits(rows):
        """Two eager training steps at `rows` sequences without running out of GPU memory
        (the second with AdamW's state allocated); the caching allocator emptied after."""
        peak = None
        try:
            x = inputs(rows)
            for _ in range(2):
                optimizer.zero_grad(set_to_none=True)
                mlm, nsp = losses(x)
                (mlm + nsp).backward()
                optimizer.step()
            sync()
            ok = True
            if device.type == "cuda":
                peak = torch.cuda.max_memory_reserved(device)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as error:
            # cuBLAS's and cuDNN's allocation failures are RuntimeErrors (accelerate's
            # should_reduce_batch_size tells them apart the same way); anything else is a bug.
            message = str(error)
            if not isinstance(error, torch.cuda.OutOfMemoryError) and not (
                "out of memory" in message or "CUBLAS_STATUS_ALLOC_FAILED" in message
            ):
                raise
            ok = False
            # AdamW may have been building its state when memory ran out: a half-built entry
            # would fail the next try's step. The next try builds it again, as a first step.
            optimizer.state.clear()
            error = None
        x = mlm = nsp = None
        optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        return {"fits": ok, "reserved_bytes": peak}

    reply(
        {
            "ready": True,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "threads": torch.get_num_threads(),
            "device": str(device),
            "parameters": sum(p.numel() for p in model.parameters()),
            "attn_implementation": model.config._attn_implementation,
            "precision": args.precision,
            "optimizer": "AdamW (fused)" if fused else "AdamW (for-loop)",
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "loss":
            with torch.no_grad():
                mlm, nsp = losses(given)
            reply({"loss": (mlm + nsp).item(), "mlm_loss": mlm.item(), "nsp_loss": nsp.item()})
        elif cmd["cmd"] == "steps":
            seconds, values = [], []
            for _ in range(cmd["n"]):
                start = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                mlm, nsp = step_losses(given)
                loss = mlm + nsp
                loss.backward()
                optimizer.step()
                value = loss.item()
                sync()
                seconds.append(time.perf_counter() - start)
                values.append(value)
            reserved = torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None
            reply({"seconds": seconds, "losses": values, "reserved_bytes": reserved})
        elif cmd["cmd"] == "gemm":
            n, best = cmd["n"], float("inf")
            gemm_dtype = DTYPES[cmd.get("dtype", "f32")]
            a = torch.rand(n, n, device=device, dtype=gemm_dtype)
            c = torch.rand(n, n, device=device, dtype=gemm_dtype)
            a @ c
            sync()
            for _ in range(cmd["reps"]):
                start = time.perf_counter()
                a @ c
                sync()
                best = min(best, time.perf_counter() - start)
            reply({"gflops": 2 * n**3 / best / 1e9})
        elif cmd["cmd"] == "fits":
            reply(fits(cmd["batch"]))
        elif cmd["cmd"] == "quit":
            return
        else:
            reply({"error": f"unknown command {cmd['cmd']}"})


if __name__ == "__main__":
    main()
