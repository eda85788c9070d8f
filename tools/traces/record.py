"""Records the tensor storage allocations and frees of real PyTorch models on
the CPU and saves them as a PyTorch memory snapshot (the pickle that
torch.cuda.memory._dump_snapshot writes), gzip-compressed.

How allocations are observed: torch.profiler with profile_memory=True makes
the CPU allocator report every allocation and free (address, +/- bytes, and the
allocator's running total) as an Allocation event. The running total is
updated and reported under the allocator's own lock, so it fixes the true
global order even where two events share a timestamp; the recorder checks that
chain, pairs every free with its allocation by address and size, and refuses
to save a trace whose live bytes would go negative.

Models have random weights; nothing is downloaded. Each iteration of a model
ends with a "snapshot" entry (addr 0, size 0), an action torch's format has,
which marks the iteration boundary for the replay tool.

    python tools/traces/record.py gpt2-train  --out tools/traces/gpt2_train.pickle.gz
    python tools/traces/record.py gpt2-decode --out tools/traces/gpt2_decode.pickle.gz
    python tools/traces/record.py resnet-train --out tools/traces/resnet18_train.pickle.gz
"""
from __future__ import annotations

import argparse
import gzip
import pickle
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch._C._profiler import _EventType  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

ITERATION_MARK = "snapshot"


# ---------------------------------------------------------------- models

class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=2)
        q, k, v = (t.view(batch, seq, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            # A growing KV cache as Hugging Face's DynamicCache keeps it: the
            # new keys/values are concatenated, so every step reallocates both.
            if cache:
                k = torch.cat([cache[0], k], dim=2)
                v = torch.cat([cache[1], v], dim=2)
            cache[:] = [k, v]
        # Causal masking only while queries and keys cover the same positions
        # (the prompt); a single decoding query attends to the whole cache.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] == k.shape[2])
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor, cache: list | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache)
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """GPT-2 (Radford et al. 2019) shape: learned positions, pre-LN blocks,
    LM head tied to the token embedding."""

    def __init__(self, layers: int, d_model: int, n_heads: int, vocab: int, max_seq: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(max_seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)

    def forward(self, tokens: torch.Tensor, caches: list | None = None, start: int = 0) -> torch.Tensor:
        positions = torch.arange(start, start + tokens.shape[1])
        x = self.wte(tokens) + self.wpe(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, caches[i] if caches is not None else None)
        return self.ln_f(x) @ self.wte.weight.t()


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """ResNet-18 (He et al. 2016): 7x7 stem, four stages of two basic blocks."""

    def __init__(self, classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        stages, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            stages += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def move_to_device(model: nn.Module) -> nn.Module:
    """Gives every parameter and buffer a fresh storage, inside the recording,
    as model.to("npu") would: the trace starts with the model being loaded.
    (The construction-time storages are dropped; the profiler never saw them.)"""
    return model._apply(lambda t: t.clone())


# ---------------------------------------------------------------- workloads
# Each runs inside the recording, calls mark() at the end of every iteration
# and returns (its description, what stays resident afterwards).

def gpt2_train(args: argparse.Namespace, mark) -> tuple[dict, object]:
    model = move_to_device(GPT2(args.layers, args.d_model, args.heads, args.vocab, max(args.seq_lens)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    for seq in args.seq_lens:
        tokens = torch.randint(args.vocab, (args.batch, seq + 1))
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del tokens, logits, loss
        mark()
    return {"model": "GPT-2 (hand-written)", "layers": args.layers, "d_model": args.d_model,
            "heads": args.heads, "vocab": args.vocab, "batch": args.batch, "seq_lens": args.seq_lens,
            "optimizer": "AdamW(foreach=True)"}, (model, optimizer)


def gpt2_decode(args: argparse.Namespace, mark) -> tuple[dict, object]:
    model = move_to_device(GPT2(args.layers, args.d_model, args.heads, args.vocab,
                                max(args.prompt_lens) + args.new_tokens))
    model.eval()
    with torch.no_grad():
        for prompt_len in args.prompt_lens:
            caches = [[] for _ in range(args.layers)]
            tokens = torch.randint(args.vocab, (args.batch, prompt_len))
            logits = model(tokens, caches)
            position = prompt_len
            for _ in range(args.new_tokens):
                next_token = logits[:, -1:].argmax(-1)
                del logits
                logits = model(next_token, caches, position)
                position += 1
                del next_token
            del tokens, logits, caches
            mark()
    return {"model": "GPT-2 decoder, KV cache grown by torch.cat", "layers": args.layers,
            "d_model": args.d_model, "heads": args.heads, "vocab": args.vocab, "batch": args.batch,
            "prompt_lens": args.prompt_lens, "new_tokens": args.new_tokens}, model


def resnet_train(args: argparse.Namespace, mark) -> tuple[dict, object]:
    model = move_to_device(ResNet18(args.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4, foreach=True)
    for _ in range(args.iterations):
        images = torch.randn(args.batch, 3, args.image, args.image)
        labels = torch.randint(args.classes, (args.batch,))
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del images, labels, loss
        mark()
    return {"model": "ResNet-18 (hand-written)", "classes": args.classes, "batch": args.batch,
            "image": args.image, "iterations": args.iterations,
            "optimizer": "SGD(momentum=0.9, weight_decay=1e-4, foreach=True)"}, (model, optimizer)


WORKLOADS = {"gpt2-train": gpt2_train, "gpt2-decode": gpt2_decode, "resnet-train": resnet_train}


# ---------------------------------------------------------------- recording

class TraceError(Exception):
    pass


# An iteration mark is a byte tensor of this size, allocated and freed at the
# end of an iteration: it lands in the profiler's ordered stream at exactly that
# point. (Zero-byte tensors are never reported.) The recorder knows each mark's
# address, so a real allocation of the same size is never taken for one.
MARK_BYTES = 7919


def record(workload, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Runs the workload under the profiler; returns its device trace (alloc,
    free_requested, free_completed and iteration marks, in order) and the
    workload's description."""
    marks: list[int] = []

    def mark():
        marker = torch.empty(MARK_BYTES, dtype=torch.uint8)
        marks.append(marker.data_ptr())

    # The workload hands back what stays resident (model, optimizer state) so
    # that it is freed only after recording stops, as in a snapshot taken
    # while a program runs.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        description, resident = workload(args, mark)
    del resident
    allocations = []

    def collect(event):
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields = event.extra_fields
            allocations.append((event.start_time_ns, fields.ptr, fields.alloc_size, fields.total_allocated))
        for child in event.children:
            collect(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        collect(root)
    allocations.sort(key=lambda e: e[0])
    return to_device_trace(order_by_running_total(allocations), marks), description


def order_by_running_total(allocations: list[tuple]) -> list[tuple]:
    """Puts events that share a timestamp into the order in which the
    allocator counted them: each event's running total must equal the previous
    one's plus its own +/- bytes."""
    ordered: list[tuple] = []
    i = 0
    while i < len(allocations):
        j = i
        while j < len(allocations) and allocations[j][0] == allocations[i][0]:
            j += 1
        group = list(allocations[i:j])
        total = ordered[-1][3] if ordered else group[0][3] - group[0][2]
        while group:
            pick = next((e for e in group if e[3] == total + e[2]), group[0])
            group.remove(pick)
            ordered.append(pick)
            total = pick[3]
        i = j
    breaks = sum(1 for a, b in zip(ordered, ordered[1:]) if b[3] != a[3] + b[2])
    if breaks:
        raise TraceError(f"{breaks} events out of the allocator's order (running total broken)")
    return ordered


def to_device_trace(allocations: list[tuple], marks: list[int]) -> list[dict]:
    """Profiler events to torch's device_traces entries, with a "snapshot"
    entry where each iteration mark was allocated (its own alloc and free are
    dropped). Frees of storages made before recording began never reach the
    profiler; any free without its live allocation is an error."""
    t0 = allocations[0][0] if allocations else 0
    live: dict[int, int] = {}
    live_bytes = 0
    pending_marks = list(reversed(marks))
    mark_addresses: set[int] = set()
    trace = []
    for t_ns, ptr, delta, _total in allocations:
        time_us = (t_ns - t0) // 1000
        if delta == MARK_BYTES and pending_marks and ptr == pending_marks[-1]:
            pending_marks.pop()
            mark_addresses.add(ptr)
            trace.append({"action": ITERATION_MARK, "addr": 0, "size": 0, "stream": 0,
                          "time_us": time_us, "frames": []})
        elif delta == -MARK_BYTES and ptr in mark_addresses:
            mark_addresses.remove(ptr)
        elif delta > 0:
            if ptr in live:
                raise TraceError(f"allocation at {ptr:#x} while a block there is still live")
            live[ptr] = delta
            live_bytes += delta
            trace.append({"action": "alloc", "addr": ptr, "size": delta, "stream": 0,
                          "time_us": time_us, "frames": []})
        else:
            size = live.pop(ptr, None)
            if size != -delta:
                raise TraceError(f"free of {-delta} bytes at {ptr:#x} that was allocated with {size}")
            live_bytes -= size
            for action in ("free_requested", "free_completed"):
                trace.append({"action": action, "addr": ptr, "size": size, "stream": 0,
                              "time_us": time_us, "frames": []})
        if live_bytes < 0:
            raise TraceError("live bytes went negative")
    if pending_marks:
        raise TraceError(f"{len(pending_marks)} iteration marks never reached the profiler")
    return trace


def snapshot(trace: list[dict], description: dict) -> dict:
    """torch's snapshot dict: one device, no segments (there is no caching
    allocator on the CPU to describe), the trace, and how it was made."""
    return {"segments": [], "device_traces": [trace], "allocator_settings": {},
            "npualloc_recording": description}


def summarize(trace: list[dict]) -> dict:
    allocs = [e for e in trace if e["action"] == "alloc"]
    live = peak = 0
    for e in trace:
        if e["action"] == "alloc":
            live += e["size"]
            peak = max(peak, live)
        elif e["action"] == "free_completed":
            live -= e["size"]
    return {"events": len(trace), "allocs": len(allocs),
            "iterations": sum(1 for e in trace if e["action"] == ITERATION_MARK),
            "peak_live_bytes": peak, "live_at_end": live}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("--out", required=True, help="output .pickle.gz")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    gpt = parser.add_argument_group("GPT-2 (gpt2-train, gpt2-decode)")
    gpt.add_argument("--layers", type=int, default=12)
    gpt.add_argument("--d-model", type=int, default=768)
    gpt.add_argument("--heads", type=int, default=12)
    gpt.add_argument("--vocab", type=int, default=50257)
    gpt.add_argument("--batch", type=int, default=None,
                     help="batch size (default: 4 for gpt2-train, 4 for gpt2-decode, 32 for resnet-train)")
    gpt.add_argument("--seq-lens", type=int, nargs="+", default=[256, 64, 192, 128, 256, 96, 160, 224],
                     help="gpt2-train: one training step per sequence length")
    gpt.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 128, 128],
                     help="gpt2-decode: one request per prompt length")
    gpt.add_argument("--new-tokens", type=int, default=64, help="gpt2-decode: tokens generated per request")
    cnn = parser.add_argument_group("ResNet-18 (resnet-train)")
    cnn.add_argument("--classes", type=int, default=1000)
    cnn.add_argument("--image", type=int, default=128)
    cnn.add_argument("--iterations", type=int, default=6)
    args = parser.parse_args(argv)
    if args.batch is None:
        args.batch = {"gpt2-train": 4, "gpt2-decode": 4, "resnet-train": 32}[args.workload]

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    try:
        trace, description = record(WORKLOADS[args.workload], args)
    except TraceError as e:
        print(f"record.py: {e}", file=sys.stderr)
        return 1
    # str(): torch.__version__ is a TorchVersion, which would make unpickling import torch.
    description.update(workload=args.workload, torch=str(torch.__version__), threads=args.threads,
                       seed=args.seed, command="python tools/traces/record.py " + " ".join(
                           sys.argv[1:] if argv is None else argv))
    with gzip.GzipFile(args.out, "wb", compresslevel=9, mtime=0) as f:
        pickle.dump(snapshot(trace, description), f, protocol=4)
    summary = summarize(trace)
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    print(args.out, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
