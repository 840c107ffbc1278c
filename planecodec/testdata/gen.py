#!/usr/bin/python3
"""Generates the realistic test data of package planecodec from a real training run.

A small byte-level GPT (2 layers, d_model 128, 4 heads, MLP 384, context 64, vocabulary 256, tied
embedding) is trained with AdamW for STEPS steps on a seeded synthetic text (Zipf-distributed
words), on the CPU. Then its weights and both Adam moments (exp_avg, exp_avg_sq) are written as raw
little-endian tensors, every parameter one after the other in named_parameters() order, the way a
flat checkpoint file holds them:

    weights_fp32.bin  adam_m_fp32.bin  adam_v_fp32.bin   float32, the training state itself
    weights_bf16.bin  adam_m_bf16.bin  adam_v_bf16.bin   the same tensors .to(torch.bfloat16)

and tensors.tsv lists name, shape, element offset and count. Run it with Debian's python3-torch
(`apt-get install -y python3-torch`; torch 1.13, CPU), from anywhere:

    /usr/bin/python3 planecodec/testdata/gen.py

It takes about 10 CPU-minutes (15 minutes on a busy 2-CPU machine). The bytes depend on torch's
version and the CPU's kernels, so a rerun elsewhere gives statistically equivalent, not identical,
files.
"""
import os
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

SEED = 1234
STEPS = 300
BATCH = 32
CONTEXT = 64
D_MODEL = 128
HEADS = 4
LAYERS = 2
MLP = 384
VOCAB = 256
LR = 3e-3
WARMUP = 30
WEIGHT_DECAY = 0.1

OUT = os.path.dirname(os.path.abspath(__file__))


def synthetic_text(n_bytes):
    """Seeded pseudo-language: 2,000 random words drawn with Zipf frequencies, with punctuation."""
    rng = random.Random(SEED)
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    weights = [1 / (i + 1) for i in range(len(letters))]
    words = ["".join(rng.choices(letters, weights, k=rng.randint(1, 9))) for _ in range(2000)]
    zipf = [1 / (i + 1) for i in range(len(words))]
    out, size, sentence = [], 0, 0
    while size < n_bytes:
        w = rng.choices(words, zipf)[0]
        if sentence == 0:
            w = w.capitalize()
        sentence += 1
        if sentence > rng.randint(4, 14):
            w += rng.choice([".", ".", ".", "?", "!"]) + ("\n" if rng.random() < 0.2 else "")
            sentence = 0
        elif rng.random() < 0.08:
            w += ","
        out.append(w)
        size += len(w) + 1
    return " ".join(out).encode()[:n_bytes]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.ln2 = nn.LayerNorm(D_MODEL)
        self.fc = nn.Linear(D_MODEL, MLP)
        self.out = nn.Linear(MLP, D_MODEL)
        mask = torch.triu(torch.ones(CONTEXT, CONTEXT, dtype=torch.bool), diagonal=1)
        self.register_buffer("mask", mask)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D_MODEL, dim=2)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // HEADS) ** 0.5
        att = att.masked_fill(self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(CONTEXT, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D_MODEL)
        for name, p in self.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.T  # tied output head


def main():
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    data = torch.tensor(list(synthetic_text(1 << 20)), dtype=torch.long)
    model = GPT()
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    other = [p for n, p in model.named_parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                             {"params": other, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    for step in range(STEPS):
        ix = torch.randint(len(data) - CONTEXT - 1, (BATCH,))
        x = torch.stack([data[i:i + CONTEXT] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + CONTEXT] for i in ix])
        loss = F.cross_entropy(model(x).view(-1, VOCAB), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == STEPS - 1:
            print(f"step {step:4d}  loss {loss.item():.3f}")

    named = list(model.named_parameters())
    tensors = {
        "weights": [p.detach() for _, p in named],
        "adam_m": [opt.state[p]["exp_avg"] for _, p in named],
        "adam_v": [opt.state[p]["exp_avg_sq"] for _, p in named],
    }
    for kind, ts in tensors.items():
        flat = torch.cat([t.reshape(-1) for t in ts])
        for dtype, suffix in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            raw = flat.to(dtype).view(torch.int32 if dtype == torch.float32 else torch.int16)
            path = os.path.join(OUT, f"{kind}_{suffix}.bin")
            with open(path, "wb") as f:
                f.write(raw.numpy().astype(raw.numpy().dtype.newbyteorder("<")).tobytes())
            print(f"{os.path.basename(path)}: {os.path.getsize(path)} bytes")
    with open(os.path.join(OUT, "tensors.tsv"), "w") as f:
        f.write("name\tshape\toffset\telements\n")
        off = 0
        for name, p in named:
            f.write(f"{name}\t{'x'.join(map(str, p.shape))}\t{off}\t{p.numel()}\n")
            off += p.numel()
    print(f"{off} parameters, torch {torch.__version__}")


if __name__ == "__main__":
    main()
