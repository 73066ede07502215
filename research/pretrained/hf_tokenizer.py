"""A run's tokenizer as Hugging Face files: what an import keeps of a checkpoint's tokenizer, and
what an export writes for transformers (AutoTokenizer), with the special-token ids of config.json
and generation_config.json.

A checkpoint's tokenizer is its FILES that exist (tokenizer.json, which the lab reads, and the
settings around it), copied into RUN/tokenizer at import and from there into an export. The
export's tokenizer_config.json names PreTrainedTokenizerFast where the checkpoint named no class:
AutoTokenizer then reads tokenizer.json as it is, rather than building the tokenizer class of
config.json's model_type (transformers 5's Qwen2Tokenizer, say, rebuilds the pre-tokenizer and
normalizer from its own code).

The lab's byte-level tokenizer (research.data.tokenizer: byte b is token b, END_OF_DOCUMENT 256,
PAD 257) has an exact equivalent, written as its tokenizer.json: a BPE without merges whose 256
symbols are the ByteLevel pre-tokenizer's characters of the bytes (GPT-2's byte-to-character map,
without its regex split), each with the byte's id, so every byte of a text is one token; and the
special tokens BYTE_EOS = 256 and BYTE_PAD = 257. Its tokenizer_config.json sets
split_special_tokens, so that a text holding those strings is encoded as its bytes, as the lab
does (the tokenizers library alone does not keep that setting: set encode_special_tokens there).
"""

import json
import os

from research.data import tokenizer
from research.data import vocab

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
         "chat_template.jinja")
SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
BYTE_EOS, BYTE_PAD = "<|endoftext|>", "<|pad|>"
GENERIC_CLASS = "PreTrainedTokenizerFast"  # transformers' class for a tokenizer.json as it is


def checkpoint_files(checkpoint_dir: str, hf: dict) -> dict:
  """{file name: text} of the checkpoint's tokenizer to keep in RUN/tokenizer (empty if it has
  no tokenizer.json): FILES as they are, tokenizer_config.json given the eos_token of
  config.json's eos_token_id where it names none (the lab separates documents with it)."""
  if not os.path.exists(os.path.join(checkpoint_dir, "tokenizer.json")):
    return {}
  files = {}
  for name in FILES:
    if os.path.exists(os.path.join(checkpoint_dir, name)):
      with open(os.path.join(checkpoint_dir, name)) as f:
        files[name] = f.read()
  settings = json.loads(files.get("tokenizer_config.json", "{}"))
  eos_id = hf.get("eos_token_id")
  eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
  if not settings.get("eos_token") and eos_id is not None:
    vocabulary = {token["id"]: token["content"]
                  for token in json.loads(files["tokenizer.json"]).get("added_tokens", [])}
    settings["eos_token"] = vocabulary.get(eos_id)
  files["tokenizer_config.json"] = json.dumps(settings)
  return files


def export_files(tokens) -> dict:
  """{file name: text} that AutoTokenizer loads as the run's tokenizer `tokens`
  (research.data.tokenizer): the byte-level equivalent, or the run's FILES (module docstring)."""
  if isinstance(tokens, tokenizer.ByteTokenizer):
    return _byte_files()
  files = {}
  for name in FILES:
    if os.path.exists(os.path.join(tokens.name, name)):
      with open(os.path.join(tokens.name, name)) as f:
        files[name] = f.read()
  settings = json.loads(files["tokenizer_config.json"])  # the lab reads its eos_token
  settings.setdefault("tokenizer_class", GENERIC_CLASS)
  files["tokenizer_config.json"] = json.dumps(settings, indent=2)
  return files


def _byte_files() -> dict:
  import tokenizers  # noqa: PLC0415 (only when exporting)
  from tokenizers import decoders, models, pre_tokenizers  # noqa: PLC0415
  symbols = _byte_symbols()
  byte_level = tokenizers.Tokenizer(models.BPE(
      vocab={symbols[byte]: byte for byte in range(256)}, merges=[]))
  byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  byte_level.decoder = decoders.ByteLevel()
  byte_level.add_special_tokens([tokenizers.AddedToken(BYTE_EOS, special=True),  # 256 = EOD
                                 tokenizers.AddedToken(BYTE_PAD, special=True)])  # 257 = PAD
  settings = {"tokenizer_class": GENERIC_CLASS, "eos_token": BYTE_EOS, "pad_token": BYTE_PAD,
              "split_special_tokens": True}
  return {"tokenizer.json": byte_level.to_str(pretty=True),
          "tokenizer_config.json": json.dumps(settings, indent=2)}


def _byte_symbols() -> dict:
  """{byte: its character} of the ByteLevel pre-tokenizer (GPT-2's bytes_to_unicode): printable
  Latin-1 bytes are themselves, the others 256, 257, ... in byte order."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  others = [byte for byte in range(256) if byte not in printable]
  return {**{byte: chr(byte) for byte in printable},
          **{byte: chr(256 + i) for i, byte in enumerate(others)}}


def special_ids(tokens) -> dict:
  """{bos_token_id, eos_token_id, pad_token_id} of the run's tokenizer `tokens`, those it has:
  END_OF_DOCUMENT and PAD of the byte-level one (no BOS: the lab starts no text with one); the
  tokens tokenizer_config.json names of a Hugging Face one (the lab's end of document is its
  eos_token)."""
  if isinstance(tokens, tokenizer.ByteTokenizer):
    return {"eos_token_id": vocab.EOD, "pad_token_id": vocab.PAD}
  with open(os.path.join(tokens.name, "tokenizer_config.json")) as f:
    settings = json.load(f)
  ids = {"eos_token_id": tokens.eod}
  for key in ("bos_token", "pad_token"):
    token = settings.get(key)
    token = token.get("content") if isinstance(token, dict) else token
    if token and tokens.tokenizer.token_to_id(token) is not None:
      ids[f"{key}_id"] = tokens.tokenizer.token_to_id(token)
  return ids
