"""Typed schema of the `data` group of a run (see partrain.blueprint.config.schema, which re-exports it):
where the rows come from, how they are read, rendered and labelled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

DATA_FORMATS = ("auto", "text", "chat", "sharegpt", "alpaca", "prompt_completion", "tokenized", "preference")
TRAIN_ON = ("completion", "last_turn", "all")
LONG_EXAMPLES = ("error", "truncate", "skip")


@dataclass
class DataConfig:
    source: str = "builtin"
    """builtin (this Python's standard-library sources, read at run time), builtin-chat (2,000 generated
    chats for offline fine-tuning, partrain.data.builtin_chat; `partrain data make-chat` writes them), a
    local text/jsonl/parquet file or folder, a `datasets` save_to_disk folder, or a Hub dataset id (org/name, @revision
    optional; fetched into the Hub cache, read from it with HF_HUB_OFFLINE=1)."""
    text_field: str = "text"
    """Field holding the text in jsonl/parquet records and `datasets` rows."""
    split: str = "train"
    """Split of a `datasets` source (save_to_disk DatasetDict or Hub dataset) to train on."""
    streaming: bool = False
    """Tokenize on the fly instead of into the packed cache, for corpora too large to tokenize ahead: every
    worker reads the source (a `datasets` source as an IterableDataset) and tokenizes it as it trains,
    through a seeded shuffle buffer; batches stay the same for every layout, a resume replays the stream
    to its step, and the first train.eval_batches global batches of windows are held out for evaluation
    (data.eval_fraction is not used). See partrain.data.streaming. Fine-tuning rows are rendered on the fly,
    one padded example per row (needs data.packing=false and data.long_examples=truncate or skip;
    partrain.data.example_stream)."""
    tokenizer: str = "auto"
    """auto (the model's own: model.pretrained's tokenizer when that folder ships one, else byte; the
    resolved config records which), byte (256-symbol byte-level, no download), a local folder with an HF
    tokenizer, or a Hub id (gpt2, org/name@revision) resolved through the Hub cache."""
    max_bytes: int = -1
    """Bytes of raw text read: -1 = the builtin corpus's first 8 MB and all of any other source; 0 = all;
    N = the first N bytes (the dry run and the launch say how much that leaves out)."""
    eval_fraction: float = 0.02
    """Share of the token stream held out for evaluation (the tail; not used with eval_split or eval_source)."""
    eval_split: str = ""
    """A split of the `datasets` source (a save_to_disk DatasetDict or a Hub dataset) to evaluate on, e.g.
    validation or test, instead of the held-out tail: every row of data.split then trains. With
    data.eval_source, the split of that source. "" = no split named. A split that does not exist is exit 2
    naming the ones that do. See partrain.data.eval_source."""
    eval_source: str = ""
    """A second file, folder or `datasets` folder, read as data.source is (same format, fields, tokenizer,
    max_bytes), whose rows or documents are the eval set instead of the held-out tail ("" = none)."""
    cache_dir: str = ""
    """Where tokenized, packed token files are cached (default ~/.cache/partrain/data)."""
    format: str = "auto"
    """How a row is read: text (the text_field string, packed into windows), chat ({"messages": [{role,
    content}]}), sharegpt ({"conversations": [{from, value}]}), alpaca ({instruction, input, output}),
    prompt_completion ({"prompt", "completion"}), tokenized ({"input_ids", optional "labels"}), preference
    ({"prompt", "chosen", "rejected"} as TRL defines them, text or conversations; for train.objective=dpo or
    simpo), or auto (from the first row's fields; builtin is text). See docs/data-formats.md."""
    train_on: str = "completion"
    """Fine-tuning formats: completion (loss on every assistant turn / the completion, end-of-turn token
    included: TRL's assistant_only_loss), last_turn (the last assistant turn only) or all (every token)."""
    train_on_eos: bool = True
    """Fine-tuning formats: whether the end-of-turn marker after each trained turn (the template's
    <|im_end|> or <|eot_id|>; the EOS after a plain completion) is trained with it, as axolotl's
    train_on_eos turn (true) or none (false). A model never taught its end-of-turn does not stop."""
    messages_field: str = ""
    """chat and sharegpt rows: the field holding the list of turns ("" = messages, or conversations for
    sharegpt). With data.format=auto, a first row holding this field is read as chat."""
    role_field: str = ""
    """chat and sharegpt rows: the key of a turn holding its role ("" = role, or from for sharegpt)."""
    content_field: str = ""
    """chat and sharegpt rows: the key of a turn holding its text ("" = content, or value for sharegpt)."""
    roles: Dict[str, str] = field(default_factory=dict)
    """chat and sharegpt rows: the data's role names -> system, user, assistant or tool, e.g.
    data.roles={human:user,bot:assistant} (sharegpt's human, gpt, observation, ... are known already)."""
    chat_template: str = ""
    """Jinja chat template of chat rows (and prompt_completion rows when set): "" = the tokenizer's own,
    or a built-in name (chatml, llama3, zephyr), or a file holding a template."""
    prompt_template: str = ""
    """prompt_completion rows without a chat template: the text before the completion, {prompt} replaced
    by the row's prompt ("" = the prompt as it is)."""
    packing: bool = True
    """text: documents packed into seq_len windows (the only way text is read, no document masks).
    chat, prompt_completion and tokenized: true (the default for every format) packs whole examples
    into seq_len windows by first fit, position ids restarting at 0 per example and attention kept
    inside each example (partrain.data.example_packing); false pads one example per row. Either way an
    example longer than a row is handled as data.long_examples says; the run summary reports the
    padding share."""
    skip_bad_rows: bool = False
    """Fine-tuning rows: false = a malformed row (no role or content, an unknown role, non-string content, an
    empty conversation, no assistant turn, a system turn after the start, a missing prompt, input_ids that are
    not integers, ...) stops the launch with exit 2 naming its file, line and rule; true = such rows are
    skipped and counted per rule (the counts are in the dry run's note and the run summary). Every row bad is
    still exit 2. Over-long examples are not malformed: data.long_examples decides those."""
    long_examples: str = "error"
    """Fine-tuning rows: an example longer than a row holds (train.seq_len + 1 tokens: the inputs and the
    targets shifted by one) is error (exit 2 naming file, line, length and the limit), truncate (cut to the
    row, counted; what is cut takes no loss) or skip (left out, counted). Independent of data.skip_bad_rows."""
