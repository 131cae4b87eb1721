"""DeBERTa(-v2/-v3) configuration, field-compatible with Hugging Face ``deberta-v2`` ``config.json``.

Defaults follow ``transformers.DebertaV2Config`` plus the ``getattr(config, name, default)`` fallbacks its
modeling code uses for keys the config class does not declare (``position_buckets``, ``share_att_key``,
``norm_rel_ebd``, ``conv_*``, ``embedding_size``, ``pooler_hidden_size``). A checkpoint's ``config.json``
therefore means the same thing here as in transformers, and ``to_dict()`` writes a file transformers loads.

Unknown keys are kept in ``extra`` and written back by ``to_dict()`` so a round trip loses nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

MODEL_TYPE = "deberta-v2"
CONFIG_NAME = "config.json"
RELATIVE_ATTENTION_TYPES = ("deberta", "t5")



def config_path(path: str | os.PathLike) -> str:
    """``<path>/config.json``, or ``path`` itself if it is a file."""
    p = os.fspath(path)
    return os.path.join(p, CONFIG_NAME) if os.path.isdir(p) else p


def read_config(path: str | os.PathLike) -> tuple[str, Any]:
    """Parse ``<path>/config.json`` (or ``path`` itself if it is a file); returns (the file's path, the JSON)."""
    p = config_path(path)
    with open(p, encoding="utf-8") as f:
        return p, json.load(f)


def read_checkpoint_config(path: str | os.PathLike, error: type[Exception]) -> tuple[str, Any]:
    """Parse a checkpoint directory's ``config.json``; returns (the file's path, the JSON).

    Raises:
        error: ``path`` is not a directory, the file is missing, or it is not readable JSON (the message
            names the file and the problem).
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isdir(path):
        raise error(f"{path}: not a directory")
    if not os.path.isfile(cfg_path):
        raise error(f"{cfg_path}: missing")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            return cfg_path, json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"{cfg_path}: cannot read JSON: {e}") from e


def write_config(d: dict[str, Any], out_dir: str | os.PathLike, ensure_ascii: bool = True) -> str:
    """Write ``d`` as ``<out_dir>/config.json`` (2-space indent, sorted keys, final newline); returns its path."""
    os.makedirs(out_dir, exist_ok=True)
    p = os.path.join(os.fspath(out_dir), CONFIG_NAME)
    with open(p, "w", encoding="utf-8") as f:
        json.dump(d, f, indent=2, sort_keys=True, ensure_ascii=ensure_ascii)
        f.write("\n")
    return p


# Keys HF writes that carry no meaning for inference here; dropped on read, not written back.
_IGNORED_KEYS = {"model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype"}


def normalise_pos_att_type(value: Any) -> list[str]:
    """``"p2c|c2p"`` / ``["p2c", "c2p"]`` / ``None`` -> ``["p2c", "c2p"]`` / ``[]`` (lower-case, stripped).

    Unknown terms raise ``ValueError``; the only terms DeBERTa defines are ``c2p`` and ``p2c``.
    """
    if value is None:
        return []
    if isinstance(value, str):
        items = [x.strip().lower() for x in value.split("|")]
    else:
        items = [str(x).strip().lower() for x in value]
    items = [x for x in items if x and x != "none"]
    bad = [x for x in items if x not in ("c2p", "p2c")]
    if bad:
        raise ValueError(f"pos_att_type: unknown term(s) {bad}; allowed are 'c2p' and 'p2c'")
    return items


@dataclass
class DebertaConfig:
    """Hyper-parameters of a DeBERTa-v2/v3 encoder and its task head (HF ``deberta-v2`` field names)."""

    vocab_size: int = 128100
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    intermediate_size: int = 6144
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 0
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-7
    # Relative (disentangled) attention.
    relative_attention: bool = False
    max_relative_positions: int = -1  # < 1 means "use max_position_embeddings"
    position_buckets: int = -1  # > 0 enables log buckets and sets the table to 2 * position_buckets rows
    pos_att_type: list[str] = field(default_factory=list)  # subset of ["p2c", "c2p"]
    share_att_key: bool = False  # v3: project relative embeddings with query_proj/key_proj
    norm_rel_ebd: str = "none"  # "layer_norm" applies encoder.LayerNorm to rel_embeddings
    position_biased_input: bool = True  # add absolute position embeddings to the input
    # "deberta": disentangled c2p/p2c attention (above). "t5": a learned scalar per (bucket, head) added to the
    # logits instead (Raffel et al. 2020), table ``encoder.relative_attention_bias`` [num_buckets, heads],
    # shared by all layers; pos_att_type / position_buckets are then unused. (relserve extension: transformers'
    # DebertaV2 ignores these keys.)
    relative_attention_type: str = "deberta"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    relative_attention_bidirectional: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    embedding_size: int | None = None  # None -> hidden_size; otherwise embed_proj maps to hidden_size
    # Optional convolution after the first layer (v2 xlarge/xxlarge).
    conv_kernel_size: int = 0
    conv_act: str = "tanh"
    conv_groups: int = 1
    # Heads.
    pooler_hidden_size: int | None = None  # None -> hidden_size
    pooler_hidden_act: str = "gelu"
    pooler_dropout: float = 0.0
    cls_dropout: float | None = None
    architectures: list[str] | None = None
    id2label: dict[int, str] = field(default_factory=lambda: {0: "LABEL_0", 1: "LABEL_1"})
    label2id: dict[str, int] = field(default_factory=lambda: {"LABEL_0": 0, "LABEL_1": 1})
    problem_type: str | None = None
    legacy: bool = True
    tie_word_embeddings: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pos_att_type = normalise_pos_att_type(self.pos_att_type)
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.pooler_hidden_size is None:
            self.pooler_hidden_size = self.hidden_size
        self.id2label = {int(k): str(v) for k, v in (self.id2label or {}).items()}
        if not self.label2id or set(self.label2id.values()) != set(self.id2label):
            self.label2id = {v: k for k, v in self.id2label.items()}
        else:
            self.label2id = {str(k): int(v) for k, v in self.label2id.items()}
        if self.relative_attention_type not in RELATIVE_ATTENTION_TYPES:
            raise ValueError(
                f"relative_attention_type {self.relative_attention_type!r} is not one of {list(RELATIVE_ATTENTION_TYPES)}"
            )
        if self.relative_attention_type == "t5":
            nb = self.relative_attention_num_buckets // (2 if self.relative_attention_bidirectional else 1)
            if nb < 2 or self.relative_attention_max_distance <= nb // 2:
                raise ValueError(
                    f"relative_attention_num_buckets {self.relative_attention_num_buckets} / max_distance "
                    f"{self.relative_attention_max_distance}: need >= 2 buckets per side and max_distance > "
                    f"num_buckets // 2 (per side)"
                )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})"
            )

    # -- derived quantities (the same rules HF's modeling code applies) --------------------------------------

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @num_labels.setter
    def num_labels(self, n: int) -> None:
        if n != len(self.id2label):
            self.id2label = {i: f"LABEL_{i}" for i in range(n)}
            self.label2id = {v: k for k, v in self.id2label.items()}

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def effective_max_relative_positions(self) -> int:
        """``max_relative_positions``, or ``max_position_embeddings`` when it is < 1 (HF rule)."""
        return self.max_relative_positions if self.max_relative_positions >= 1 else self.max_position_embeddings

    @property
    def att_span(self) -> int:
        """Half the number of rows of ``rel_embeddings``: ``position_buckets`` if > 0, else the max distance."""
        return self.position_buckets if self.position_buckets > 0 else self.effective_max_relative_positions

    @property
    def norm_rel_ebd_terms(self) -> list[str]:
        return [x.strip() for x in (self.norm_rel_ebd or "none").lower().split("|")]

    # -- I/O ---------------------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DebertaConfig":
        """Build from an HF-style dict. ``num_labels`` without ``id2label`` makes ``LABEL_i`` names."""
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        num_labels = d.pop("num_labels", None)
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = dict(d.pop("extra", {}) or {})
        for k, v in d.items():
            if k in known:
                kwargs[k] = v
            elif k not in _IGNORED_KEYS:
                extra[k] = v
        if "id2label" not in kwargs and num_labels is not None:
            kwargs["id2label"] = {i: f"LABEL_{i}" for i in range(int(num_labels))}
            kwargs.pop("label2id", None)
        cfg = cls(**kwargs, extra=extra)
        if num_labels is not None and int(num_labels) != cfg.num_labels:
            raise ValueError(f"num_labels={num_labels} disagrees with id2label ({cfg.num_labels} entries)")
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "DebertaConfig":
        """Read ``<path>/config.json`` (or ``path`` itself if it is a file)."""
        p, d = read_config(path)
        mt = d.get("model_type")
        if mt not in (None, MODEL_TYPE):
            raise ValueError(f"{p}: model_type {mt!r} is not supported (expected {MODEL_TYPE!r})")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """HF-compatible dict (``model_type`` "deberta-v2", string keys in ``id2label``)."""
        d: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            d[f.name] = getattr(self, f.name)
        d["pos_att_type"] = list(self.pos_att_type)
        d["id2label"] = {str(k): v for k, v in self.id2label.items()}
        d["label2id"] = dict(self.label2id)
        d["num_labels"] = self.num_labels
        if d["cls_dropout"] is None:
            del d["cls_dropout"]
        if self.relative_attention_type == "deberta":  # keep HF-style files free of the T5 extension keys
            for k in ("relative_attention_type", "relative_attention_num_buckets",
                      "relative_attention_max_distance", "relative_attention_bidirectional"):
                del d[k]
        for k, v in self.extra.items():
            d.setdefault(k, v)
        d["model_type"] = MODEL_TYPE
        return d

    def save_pretrained(self, out_dir: str | os.PathLike) -> str:
        return write_config(self.to_dict(), out_dir)
