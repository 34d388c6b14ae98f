"""Random-weight pooling checkpoints the embedding / rerank tests write: small transformers models saved as
sentence-transformers folders (by sentence-transformers itself, and one in the hub's older layout written
by hand) and a cross-encoder, each with a WordPiece or BPE tokenizer built here (no hub downloads)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

WORDS = (
    "the a of to and in is it that for on with as was at by be this are from or have an not but what all "
    "were when we there can which their if do will each about how up out them then she many some so these "
    "would other into has more her two like him see time could no make than first been its who now people "
    "paris france capital city river cat dog runs fast slow blue green red house tree water fire stone"
).split()
TEXTS = [
    "the capital of france is paris",
    "a cat runs fast",
    "blue water and green trees",
    "what is the city on the river",
    "the dog is slow",
    "fire stone house",
    "how many people have been there",
    "it was the first time",
]


def wordpiece_tokenizer(model_max_length: int = 128):
    from transformers import BertTokenizerFast

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *"abcdefghijklmnopqrstuvwxyz"]
    vocab += [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "vocab.txt").write_text("\n".join(vocab))
        return BertTokenizerFast(str(Path(tmp) / "vocab.txt"), model_max_length=model_max_length)


def bpe_tokenizer(model_max_length: int = 128, roberta: bool = False, eos: bool = False):
    """A byte-level BPE over WORDS: <s> text </s> for XLM-R-like models; text + <|endoftext|> with eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<|endoftext|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate([*specials, *sorted(alphabet)])}
    for w in WORDS:
        vocab.setdefault("Ġ" + w, len(vocab))
    merges: list[tuple[str, str]] = []
    for w in WORDS:  # build each word up from its letters: Ġ+w[0], then + w[1] ...
        piece = "Ġ" + w[0]
        merges.append(("Ġ", w[0]))
        vocab.setdefault(piece, len(vocab))
        for c in w[1:]:
            merges.append((piece, c))
            piece += c
            vocab.setdefault(piece, len(vocab))
    merges = list(dict.fromkeys(merges))
    raw = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    raw.decoder = decoders.ByteLevel()
    if roberta:
        raw.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
        )
    elif eos:
        raw.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", 4)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<s>",
        eos_token="</s>" if roberta else "<|endoftext|>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=model_max_length,
    )


def save_st(folder: Path, model, tok, pooling: str, normalize: bool, max_seq_length: int = 128) -> Path:
    """`model` + `tok` as a sentence-transformers folder saved by sentence-transformers itself."""
    from sentence_transformers import SentenceTransformer, models

    src = folder.parent / (folder.name + "-hf")
    model.save_pretrained(src)
    tok.save_pretrained(src)
    t = models.Transformer(str(src), max_seq_length=max_seq_length)
    mods = [t, models.Pooling(t.get_word_embedding_dimension(), pooling)]
    if normalize:
        mods.append(models.Normalize())
    SentenceTransformer(modules=mods, device="cpu").save(str(folder))
    shutil.rmtree(src)
    return folder


def bert_config(**kw):
    from transformers import BertConfig

    args = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    return BertConfig(vocab_size=len(WORDS) + 57, max_position_embeddings=128, **{**args, **kw})


def bert_mean_st(folder: Path) -> Path:
    """A BERT with mean pooling and Normalize, saved by sentence-transformers 6; Matryoshka declared."""
    from transformers import BertModel

    torch.manual_seed(0)
    path = save_st(folder, BertModel(bert_config()), wordpiece_tokenizer(), "mean", True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["matryoshka_dimensions"] = [16, 32, 64]
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def xlmr_cls_hub_layout(folder: Path) -> Path:
    """An XLM-R with CLS pooling and no Normalize, in the hub's (sentence-transformers 2) layout, by hand."""
    from transformers import XLMRobertaConfig, XLMRobertaModel

    torch.manual_seed(1)
    tok = bpe_tokenizer(roberta=True)
    cfg = XLMRobertaConfig(
        vocab_size=len(tok), hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96, max_position_embeddings=130, pad_token_id=1, type_vocab_size=1,
    )  # fmt: skip
    XLMRobertaModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 96, "do_lower_case": False})
    )
    (folder / "1_Pooling").mkdir()
    pooling = {f"pooling_mode_{k}": k == "cls_token" for k in ("cls_token", "mean_tokens", "max_tokens")}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 48, **pooling}))
    return folder


def qwen3_lasttoken_st(folder: Path) -> Path:
    """A Qwen3 with last-token pooling and Normalize (Qwen3-Embedding's shape), saved by sentence-transformers."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(2)
    tok = bpe_tokenizer(eos=True)
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=True,
    )  # fmt: skip
    tok.padding_side = "left"
    return save_st(folder, Qwen3Model(cfg), tok, "lasttoken", True)


def bert_cross_encoder(folder: Path) -> Path:
    """A BertForSequenceClassification with one label: CrossEncoder.predict applies a sigmoid."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(3)
    model = BertForSequenceClassification(bert_config(num_labels=1))
    model.save_pretrained(folder)
    wordpiece_tokenizer().save_pretrained(folder)
    return folder


def xlmr_cross_encoder(folder: Path) -> Path:
    """An XLMRobertaForSequenceClassification with one label (its classifier: dense + tanh + out_proj)."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    torch.manual_seed(4)
    tok = bpe_tokenizer(roberta=True)
    cfg = XLMRobertaConfig(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=130, pad_token_id=1, num_labels=1,
    )  # fmt: skip
    XLMRobertaForSequenceClassification(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
