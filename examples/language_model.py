#!/usr/bin/python3
"""Train a Transformer language model on Debian's fortunes as one worker of a sparseps job.

The text: the English fortune cookies of Debian's `fortunes` package (/usr/share/games/fortunes,
data.dir; deploy/install-deps.sh installs it): 2.5 MB, 458k words in 69k lines, in main, on every
Debian mirror, plain text in one format. No other English text corpus of that size is packaged;
it is small enough for a Transformer to learn on two cores in minutes and large enough not to be
memorised in a few epochs. Each fortune (the files' "%"-separated entries, in file order) goes to
the test set when its index is a multiple of 10, else to the training set; words are lower-cased
and split from punctuation, and the vocabulary is <unk>, <eos> and the 8,190 most frequent tokens
of the training set. Each split is one stream of its fortunes, each followed by <eos>, cut into
windows of --context + 1 tokens: each window trains the model to predict every next token in it.
Test perplexity = exp(mean cross-entropy per token), over the test windows.

    examples/language_model.py --config examples/torch_lm.yaml --set node.rank=0 \\
        [--set key=value ...] [--model transformer|bert] [--device cuda] [--optimizer adam]

Models: transformer (a GPT-style decoder: token and position embeddings, --layers pre-norm
layers of --heads heads, width --dim, feed-forward 4 x --dim, a causal mask, an untied output
layer: 2,506,240 parameters at the defaults), bert (BERT-base's shape: 12 layers, width 768, 12
heads, a 30,522-token vocabulary, 128-token windows; 132,066,618 parameters with the untied output
layer; --synthetic only: random tokens, for a large model's step time and bytes, the perplexity
means nothing).

The loop is examples/torch_job.py's (the options --ddp, --ddp-hook, --optimizer, --aggregate,
--device, --capi are there), started like the C++ worker, so deploy/launch.sh and
bench/sparseps-compare run it (configs/compare_lm_1gbit.yaml, with `metric: perplexity`).
"""
import collections
import os
import re

import torch
import torch.nn as nn

import torch_job

VOCAB = 8192  # <unk>, <eos> and the 8,190 most frequent training tokens
UNK, EOS = 0, 1
BERT_VOCAB = 30522  # --model bert: BERT-base's WordPiece vocabulary size
TOKEN = re.compile(r"[a-z0-9']+|[^\sa-z0-9']")


def fortunes(data_dir):
    """The fortunes of data_dir's files (those without a suffix: not the .dat indexes or .u8
    links), in sorted file order, each a string."""
    try:
        names = sorted(f for f in os.listdir(data_dir)
                       if "." not in f and os.path.isfile(os.path.join(data_dir, f)))
    except OSError as e:
        raise ValueError(f"data.dir {data_dir}: {e.strerror} (deploy/install-deps.sh installs "
                         "Debian's fortunes)") from e
    out = []
    for name in names:
        with open(os.path.join(data_dir, name), encoding="utf-8", errors="replace") as f:
            out += [t.strip() for t in re.split(r"^%$", f.read(), flags=re.M) if t.strip()]
    if not out:
        raise ValueError(f"data.dir {data_dir}: no fortunes there (Debian's fortunes package "
                         "puts them in /usr/share/games/fortunes)")
    return out


def tokenize(text):
    return TOKEN.findall(text.lower())


def corpus(data_dir, context):
    """(x, y, xt, yt): windows of `context` tokens and their next tokens, the training set's and
    the test set's (every 10th fortune), as int64 tensors of ids below VOCAB."""
    docs = [tokenize(t) for t in fortunes(data_dir)]
    train = [d for i, d in enumerate(docs) if i % 10]
    test = [d for i, d in enumerate(docs) if i % 10 == 0]
    counts = collections.Counter(w for d in train for w in d)
    words = ["<unk>", "<eos>"] + [w for w, _ in counts.most_common(VOCAB - 2)]
    ids = {w: i for i, w in enumerate(words)}

    def windows(split):
        stream = []
        for d in split:
            stream += [ids.get(w, UNK) for w in d] + [EOS]
        t = torch.tensor(stream, dtype=torch.int64)
        n = (len(t) - 1) // context
        x = t[:n * context].view(n, context)
        y = t[1:n * context + 1].view(n, context)
        return x, y

    x, y = windows(train)
    xt, yt = windows(test)
    return x, y, xt, yt


class Decoder(nn.Module):
    """A GPT-style decoder: token + learned position embeddings, `layers` pre-norm Transformer
    layers (torch's nn.TransformerEncoderLayer with a causal mask, GELU, no dropout), a final
    LayerNorm and an untied output layer. forward: N x T token ids -> N x T x vocab logits."""

    def __init__(self, vocab, context, dim, layers, heads):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(context, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)
        self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")),
                                                diagonal=1), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        h = self.embed(x) + self.position(torch.arange(t, device=x.device))
        h = self.layers(h, mask=self.mask[:t, :t])
        return self.out(self.norm(h))


def main():
    ap = torch_job.parser(__doc__, ["transformer", "bert"])
    ap.add_argument("--context", type=int, default=32, help="tokens per window")
    ap.add_argument("--dim", type=int, default=128, help="transformer: the model width")
    ap.add_argument("--layers", type=int, default=2, help="transformer: layers")
    ap.add_argument("--heads", type=int, default=4, help="transformer: attention heads")
    args = ap.parse_args()
    if args.model == "bert" and not args.synthetic:
        raise ValueError("--model bert: --synthetic only (no data set of its size is packaged)")
    def load_data(args, get):
        if args.synthetic:
            v = BERT_VOCAB if args.model == "bert" else VOCAB
            g = torch.Generator().manual_seed(get("train.seed"))
            x = torch.randint(0, v, (20000, args.context + 1), generator=g)
            xt = torch.randint(0, v, (500, args.context + 1), generator=g)
            return x[:, :-1], x[:, 1:], xt[:, :-1], xt[:, 1:], f"random tokens (vocabulary {v})"
        x, y, xt, yt = corpus(get("data.dir"), args.context)
        return x, y, xt, yt, (f"Debian's fortunes, {x.numel()} training and {xt.numel()} test "
                              f"tokens, vocabulary {VOCAB}")

    def build_model(name, get):
        if name == "bert":
            return Decoder(BERT_VOCAB, args.context, 768, 12, 12)
        return Decoder(VOCAB, args.context, args.dim, args.layers, args.heads)

    torch_job.run(args, build_model, load_data, perplexity=True)


if __name__ == "__main__":
    torch_job.main(main, "language_model.py")
