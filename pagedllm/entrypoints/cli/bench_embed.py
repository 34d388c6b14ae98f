"""`pagedllm bench embed`: embedding throughput (sequences/s, tokens/s) of the pooling engine over a fixed,
seeded set of texts (lengths 16-512 tokens by default), beside sentence-transformers' `encode` on the same
folder in the same run, and how close their vectors are.

    pagedllm bench embed --model ST_FOLDER
    pagedllm bench embed --random-bert-base DIR     # writes a BERT-base-shaped random model there first

Both sides tokenize inside the timed region (sentence-transformers' encode does). sentence-transformers
runs in float32 (its default) and, with --st-dtypes fp32,bf16, in bf16 too; pagedllm in --dtype (auto:
bf16 where the CPU multiplies it natively).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from pagedllm.entrypoints.engine_args import add_model_args
from pagedllm.errors import InputError

BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
RANDOM_VOCAB = 30522  # bert-base-uncased's size


def add_embed_parser(sub) -> None:
    e = sub.add_parser(
        "embed",
        help="embedding throughput: the pooling engine beside sentence-transformers encode",
        description=__doc__.split("\n\n")[0],
    )
    add_model_args(e)
    e.add_argument(
        "--random-bert-base",
        default=None,
        metavar="DIR",
        help="write a BERT-base-shaped random sentence-transformers folder (mean pooling + Normalize) to DIR "
        "unless it is there, and benchmark it (instead of --model)",
    )
    e.add_argument("--num-texts", type=int, default=256, help="texts to embed (default: 256)")
    e.add_argument("--min-len", type=int, default=16, help="shortest text in tokens (default: 16)")
    e.add_argument("--max-len", type=int, default=512, help="longest text in tokens (default: 512)")
    e.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="pagedllm's token budget a forward"
    )
    e.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch (default: 32)")
    e.add_argument(
        "--st-dtypes",
        default="fp32",
        help="sentence-transformers' dtypes, comma-separated: fp32, bf16 (default: fp32)",
    )
    e.add_argument("--repeat", type=int, default=1, help="timed runs of each; the best counts (default: 1)")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--output-json", default=None, help="write the report here")
    e.set_defaults(run=run_embed)


def write_random_bert_base(folder: Path) -> Path:
    """A BERT-base-shaped random model as a sentence-transformers folder, with a WordPiece vocabulary of
    RANDOM_VOCAB made-up words (each one token), so that a text's token count is its word count + 2."""
    if (folder / "modules.json").is_file():
        return folder
    import tempfile

    import torch
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    torch.manual_seed(0)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = specials + [f"w{i}" for i in range(RANDOM_VOCAB - len(specials))]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.txt").write_text("\n".join(vocab))
        tok = BertTokenizerFast(str(Path(tmp) / "vocab.txt"), model_max_length=512)
        hf = Path(tmp) / "hf"
        BertModel(
            BertConfig(vocab_size=len(vocab), max_position_embeddings=512, **BERT_BASE)
        ).save_pretrained(hf)
        tok.save_pretrained(hf)
        t = models.Transformer(str(hf), max_seq_length=512)
        pooling = models.Pooling(t.get_word_embedding_dimension(), "mean")
        SentenceTransformer(modules=[t, pooling, models.Normalize()], device="cpu").save(str(folder))
    return folder


def random_texts(n: int, min_len: int, max_len: int, vocab_words: list[str], seed: int) -> list[str]:
    """`n` texts of min_len..max_len tokens (two of them the tokenizer's [CLS] and [SEP])."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(vocab_words, k=rng.randint(min_len, max_len) - 2)) for _ in range(n)]


def _best(fn, repeat: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def run_embed(args: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F
    from sentence_transformers import SentenceTransformer

    from pagedllm.engine.pooling_engine import PoolingEngine

    if args.min_len < 3 or args.max_len < args.min_len:
        raise InputError("need 3 <= --min-len <= --max-len", param="--min-len")
    model = args.model
    if args.random_bert_base:
        model = str(write_random_bert_base(Path(args.random_bert_base)))
    engine = PoolingEngine(model, args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    if engine.task != "embed":
        raise InputError(f"{model} is a cross-encoder; bench embed needs an embedding model", param="--model")
    hf = engine.tokenizer.hf
    words = [w for w in hf.get_vocab() if w.isalnum() and not w.startswith("[")] or ["the"]
    texts = random_texts(
        args.num_texts, args.min_len, min(args.max_len, engine.max_model_len), words, args.seed
    )
    tokens = sum(len(hf(t, truncation=True, max_length=engine.max_model_len)["input_ids"]) for t in texts)

    def ours():
        return engine.embed([engine.tokenize(t, engine.max_model_len) for t in texts])

    ours()  # warm-up: every kernel and allocation once
    seconds, vectors = _best(ours, args.repeat)
    rows = [{"system": "pagedllm", "dtype": str(engine.dtype).removeprefix("torch."), "seconds": seconds}]
    for name in [d.strip() for d in args.st_dtypes.split(",") if d.strip()]:
        if name not in ("fp32", "bf16"):
            raise InputError(f"--st-dtypes: {name!r} is not fp32 or bf16", param="--st-dtypes")
        st = SentenceTransformer(model, device="cpu")
        if name == "bf16":
            st = st.to(torch.bfloat16)

        def theirs(st=st):
            return torch.as_tensor(st.encode(texts, batch_size=args.st_batch_size, convert_to_numpy=False,
                                             convert_to_tensor=True)).float()  # fmt: skip

        st.encode(texts[:4])
        st_seconds, ref = _best(theirs, args.repeat)
        cos = F.cosine_similarity(vectors, ref, dim=-1)
        rows.append({"system": "sentence-transformers", "dtype": name, "seconds": st_seconds,
                     "min_cosine_to_pagedllm": float(cos.min())})  # fmt: skip
    for row in rows:
        row["seqs_per_s"] = args.num_texts / row["seconds"]
        row["tokens_per_s"] = tokens / row["seconds"]
    print(f"{args.num_texts} texts, {tokens} tokens ({args.min_len}-{args.max_len} each), {torch.get_num_threads()} "
          f"threads, model {model}")  # fmt: skip
    print(
        f"{'system':<22} {'dtype':<9} {'seconds':>8} {'seqs/s':>8} {'tokens/s':>10} {'vs ours':>8} {'min cos':>8}"
    )
    for row in rows:
        speedup = rows[0]["tokens_per_s"] / row["tokens_per_s"] if row is not rows[0] else 1.0
        cos = f"{row['min_cosine_to_pagedllm']:.5f}" if "min_cosine_to_pagedllm" in row else "-"
        print(f"{row['system']:<22} {row['dtype']:<9} {row['seconds']:>8.2f} {row['seqs_per_s']:>8.1f} "
              f"{row['tokens_per_s']:>10.0f} {speedup:>7.2f}x {cos:>8}")  # fmt: skip
    if args.output_json:
        report = {"model": model, "num_texts": args.num_texts, "tokens": tokens, "results": rows}
        Path(args.output_json).write_text(json.dumps(report, indent=2))
    return 0
