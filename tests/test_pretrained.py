"""Hugging Face checkpoints in and out (research/pretrained): tiny random checkpoints made here
with transformers, imported, and compared with transformers' own logits in fp32 and greedy
continuation; a run exported and loaded back by transformers. No network.

Needs the optional extra (CI installs it): .venv/bin/pip install -r requirements-hf.txt
"""

import json
import os
import shutil

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from research import data
from research import load_run
from research.data import catalog
from research.data import needles
from research.data import storage
from research.data import tokenizer
from research.evaluation import extrapolation
from research.evaluation import generate
from research.pretrained import convert
from research.pretrained import hf_tokenizer
from research.pretrained import hf_weights
from research.runs import checkpoints
from research.runs import config_fields

INSTALL = "the Hugging Face extra: .venv/bin/pip install -r requirements-hf.txt"
torch = transformers = None  # imported by _extra when this file's tests run, not at collection


@pytest.fixture(scope="module", autouse=True)
def _extra():
  """torch and transformers, or every test here skipped naming the install line. Imported here,
  not at the top: every pytest-xdist worker collects this file, one runs it."""
  global torch, transformers  # noqa: PLW0603
  torch = pytest.importorskip("torch", reason=INSTALL)
  transformers = pytest.importorskip("transformers", reason=INSTALL)

EOS, BOS, PAD = "<|endoftext|>", "<|startoftext|>", "<|padding|>"
VOCAB = 300  # above the lab's 258 byte tokens, which the run's default data needs
LENGTH = 14
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=8, initializer_range=0.1)

CHECKPOINTS = {
    "llama_gqa": lambda: transformers.LlamaConfig(num_key_value_heads=2, **SIZES),
    "llama_tied_biases": lambda: transformers.LlamaConfig(
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
        rms_norm_eps=1e-5, **SIZES),
    "mistral_window": lambda: transformers.MistralConfig(num_key_value_heads=2,
                                                         sliding_window=5, **SIZES),
    "qwen2_mqa_biases": lambda: transformers.Qwen2Config(num_key_value_heads=1, **SIZES),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                            n_positions=32, initializer_range=0.1),
    "mamba": lambda: transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4,
                                              num_hidden_layers=2, time_step_rank=4),
}
# Greedy continuation through the decode caches: one family each (GQA's, the rolling window's,
# learned positions', the recurrent state's); the others decode with llama_gqa's code.
GREEDY = ("llama_gqa", "mistral_window", "gpt2", "mamba")
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
}


def _save(hf_config, directory):
  torch.manual_seed(0)
  hf_model = transformers.AutoModelForCausalLM.from_config(
      hf_config, attn_implementation="eager").eval()
  hf_model.save_pretrained(directory)
  return hf_model


def _hf_logits(hf_model, tokens):
  with torch.no_grad():
    return hf_model(torch.tensor(tokens)).logits.numpy()


def _imported(tmp_path, hf_config):
  """(transformers model, lab model, the run directory) of a new tiny checkpoint."""
  checkpoint, run = str(tmp_path / "hf"), str(tmp_path / "run")
  hf_model = _save(hf_config, checkpoint)
  convert.import_checkpoint(checkpoint, run, log=lambda line: None)
  _, model = generate.restore(config_fields.load_saved(run), run, log=lambda line: None)
  return hf_model, model, run


def _relative_error(ours, theirs):
  return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def _tokens(seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (2, LENGTH))


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_an_imported_checkpoint_gives_transformers_logits_and_greedy_continuation(
    tmp_path, name):
  hf_model, model, _ = _imported(tmp_path, CHECKPOINTS[name]())
  tokens = _tokens()
  theirs = _hf_logits(hf_model, tokens)
  assert _relative_error(np.asarray(model(jnp.asarray(tokens))), theirs) < 1e-5
  if name not in GREEDY:
    return
  prompt = [int(t) for t in tokens[0, :6]]
  with torch.no_grad():
    expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                 min_new_tokens=8)[0, len(prompt):].tolist()
  ours = generate.Generator(model).generate(prompt, 8, cache_length=16).tokens
  assert list(ours) == expected


@pytest.mark.parametrize("kind", ROPE_SCALINGS)
def test_each_rope_scaling_gives_transformers_logits_beyond_the_original_length(tmp_path, kind):
  # LENGTH = 14 tokens against an original length of 8: every scaling changes the frequencies.
  config = transformers.LlamaConfig(num_key_value_heads=2, **SIZES)
  config.rope_parameters = {"rope_theta": 10000.0, **ROPE_SCALINGS[kind]}
  hf_model, model, run = _imported(tmp_path, config)
  saved = config_fields.load_saved(run).model.rope
  assert saved.scaling == {"linear": "pi", "dynamic": "dynamic_ntk"}.get(kind, kind)
  tokens = _tokens(1)
  ours = np.asarray(model(jnp.asarray(tokens)))
  assert _relative_error(ours, _hf_logits(hf_model, tokens)) < 1e-5


def test_rotary_channels_are_reordered_from_halves_to_pairs():
  weight = np.arange(2 * 6 * 3, dtype=np.float32).reshape(2 * 6, 3)  # 2 heads of 6, d_model 3
  kernel = hf_weights._heads(weight, 2, 6, rotary=True)  # noqa: SLF001
  # Head 1's channels 0, 3, 1, 4, 2, 5 of transformers' layout become the lab's 0..5.
  np.testing.assert_array_equal(kernel[:, 1], weight[[6, 9, 7, 10, 8, 11]].T)


def test_an_exported_run_loads_in_transformers_with_the_same_logits(tmp_path):
  hf_model, _, run = _imported(tmp_path, CHECKPOINTS["qwen2_mqa_biases"]())
  exported = str(tmp_path / "exported")
  convert.export_run(run, exported, log=lambda line: None)
  original = dict(hf_model.state_dict())
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      exported, attn_implementation="eager").eval()
  for name, value in reloaded.state_dict().items():
    np.testing.assert_array_equal(value.numpy(), original[name].numpy(), err_msg=name)
  tokens = _tokens(2)
  np.testing.assert_allclose(_hf_logits(reloaded, tokens), _hf_logits(hf_model, tokens),
                             rtol=0, atol=0)


def test_a_checkpoint_the_lab_cannot_hold_is_refused_before_anything_is_written(tmp_path):
  checkpoint, run = str(tmp_path / "hf"), str(tmp_path / "run")
  _save(transformers.LlamaConfig(num_key_value_heads=2, head_dim=16, **SIZES), checkpoint)
  with pytest.raises(ValueError, match="head_dim=16 has no equivalent in the lab; supported: "
                                       "hidden_size / num_attention_heads = 8"):
    convert.import_checkpoint(checkpoint, run)
  assert not os.path.exists(run)
  with open(os.path.join(checkpoint, "config.json")) as f:
    hf = json.load(f)
  with open(os.path.join(checkpoint, "config.json"), "w") as f:
    json.dump({**hf, "model_type": "gemma"}, f)
  with pytest.raises(ValueError, match="model_type 'gemma' is not supported; valid: gpt2, "
                                       "llama, mamba, mistral, qwen2"):
    convert.import_checkpoint(checkpoint, run)
  os.makedirs(run)
  open(os.path.join(run, "notes.txt"), "w").close()
  with open(os.path.join(checkpoint, "config.json"), "w") as f:
    json.dump({**hf, "head_dim": 8}, f)
  with pytest.raises(FileExistsError, match="is not empty"):
    convert.import_checkpoint(checkpoint, run)
  assert os.listdir(run) == ["notes.txt"]


def _bpe(texts, directory, **named_tokens):
  """A byte-level BPE of 280 tokens trained on `texts`, saved as a Hugging Face tokenizer: EOS
  (id 0) its end-of-sequence token, then the `named_tokens` (bos_token=BOS: ids 1, ...)."""
  import tokenizers  # noqa: PLC0415
  bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
  bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  bpe.decoder = tokenizers.decoders.ByteLevel()
  bpe.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
      vocab_size=280, special_tokens=[EOS, *named_tokens.values()],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
  bpe.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": EOS, **named_tokens}, f)
  return bpe


def _corpus(directory):
  """(the directory, its texts): a text_dir corpus of 60 random sentences of 40 words."""
  directory.mkdir()
  rng = np.random.default_rng(0)
  words = ["attention", "rotary", "window", "the", "of", "key", "value", "query", "head", "a"]
  texts = [" ".join(rng.choice(words, 40)) for _ in range(60)]
  for i, text in enumerate(texts):
    (directory / f"doc{i:02d}.txt").write_text(text)
  return str(directory), texts


def _text_dir_settings(corpus):
  """An import's data and evaluation settings: the corpus, one 16-token window (quick)."""
  return {"data.name": "text_dir", "data.corpus_path": corpus, "eval.lengths": (16,),
          "eval.modes": ("nonoverlapping",), "eval.num_tokens": 16, "eval.bootstrap_samples": 10}


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
  """(transformers model, its BPE, the imported run, the corpus texts): a tiny Llama with a
  byte-level BPE trained on a text_dir corpus of random sentences, imported with the corpus."""
  tmp_path = tmp_path_factory.mktemp("bpe_run")
  corpus, texts = _corpus(tmp_path / "corpus")
  checkpoint, run = tmp_path / "hf", str(tmp_path / "run")
  hf_model = _save(transformers.LlamaConfig(num_key_value_heads=2, **SIZES), str(checkpoint))
  bpe = _bpe(texts + [needles.FILLER.decode()] * 20, str(checkpoint))
  convert.import_checkpoint(str(checkpoint), run, log=lambda line: None,
                            overrides=_text_dir_settings(corpus))
  return hf_model, bpe, run, texts


def test_an_imported_run_moves_and_exports_what_transformers_needs(tmp_path):
  # The checkpoint's special tokens are its BPE's own, its position limit 64 (no lab default).
  corpus, texts = _corpus(tmp_path / "corpus")
  checkpoint, run = tmp_path / "hf", str(tmp_path / "run")
  hf_model = _save(transformers.LlamaConfig(
      num_key_value_heads=2, bos_token_id=1, eos_token_id=0, pad_token_id=2,
      **{**SIZES, "max_position_embeddings": 64}), str(checkpoint))
  _bpe(texts, str(checkpoint), bos_token=BOS, pad_token=PAD)
  convert.import_checkpoint(str(checkpoint), run, log=lambda line: None,
                            overrides=_text_dir_settings(corpus))
  with open(os.path.join(run, "config.json")) as f:
    assert json.load(f)["data"]["tokenizer"] == "tokenizer"  # relative to the run

  moved = str(tmp_path / "elsewhere" / "run")
  shutil.copytree(run, moved)
  shutil.rmtree(run)
  config = config_fields.load_saved(moved)
  assert config.data.tokenizer == os.path.join(moved, "tokenizer")
  data.prepare(config)
  (row,) = extrapolation.evaluate_run(config, moved, progress=lambda line: None)
  assert np.isfinite(row["loss"])
  lab_tokens = load_run(moved, log=lambda line: None).tokenizer

  exported = str(tmp_path / "exported")
  convert.export_run(moved, exported, log=lambda line: None)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      exported, attn_implementation="eager").eval()
  tokens = _tokens(4)
  np.testing.assert_array_equal(_hf_logits(reloaded, tokens), _hf_logits(hf_model, tokens))
  text = texts[0][:60] + f" ünïcode 日本\n\t{EOS}"
  hf_tokens = transformers.AutoTokenizer.from_pretrained(exported)
  assert hf_tokens.encode(text, add_special_tokens=False) == lab_tokens.encode(text).tolist()
  assert (hf_tokens.bos_token_id, hf_tokens.eos_token_id, hf_tokens.pad_token_id) == (1, 0, 2)
  generation = transformers.GenerationConfig.from_pretrained(exported)
  for settings in (generation, reloaded.config):
    assert (settings.bos_token_id, settings.eos_token_id, settings.pad_token_id) == (1, 0, 2)
  assert reloaded.config.max_position_embeddings == 64


def _scored_cross_entropy(hf_model, tokens_NxL1, mask_NxL):
  """transformers' mean cross-entropy over the scored targets of next-token rows."""
  logits = torch.tensor(_hf_logits(hf_model, tokens_NxL1[:, :-1]))
  losses = torch.nn.functional.cross_entropy(
      logits.flatten(0, 1), torch.tensor(tokens_NxL1[:, 1:]).flatten(), reduction="none")
  mask = torch.tensor(mask_NxL, dtype=torch.float32).flatten()
  return float((losses * mask).sum() / mask.sum())


def test_an_imported_run_scores_and_continues_text_through_its_tokenizer_as_transformers(
    bpe_run):
  hf_model, bpe, run, texts = bpe_run
  config = config_fields.load_saved(run)
  assert config.data.tokenizer == os.path.join(run, "tokenizer")
  data.prepare(config)
  (row,) = extrapolation.evaluate_run(config, run, progress=lambda line: None)

  # The validation stream is the documents' BPE ids, each followed by the end-of-sequence id.
  stream = np.asarray(storage.token_stream(catalog.resolve(config), storage.data_dir(config),
                                           "validation", tokenizer.get(config)), np.int64)
  eos = bpe.token_to_id(EOS)
  first = stream[:list(stream).index(eos)]
  assert bpe.decode(first.tolist()) in texts
  # The lab's loss over the window is transformers' cross-entropy of the same 16 targets.
  expected = _scored_cross_entropy(hf_model, stream[None, :17], np.ones((1, 16)))
  assert row["loss"] == pytest.approx(expected, rel=1e-5)

  prompt = texts[0][:30]
  _, result = generate.generate_from_run(run, prompt, 6, log=lambda line: None)
  prompt_ids = bpe.encode(prompt).ids
  with torch.no_grad():
    expected_ids = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=6,
                                     min_new_tokens=6, do_sample=False)[0, len(prompt_ids):]
  assert list(result.prompt) == prompt_ids
  expected_ids = expected_ids.tolist()
  expected_ids = expected_ids[:expected_ids.index(eos)] if eos in expected_ids else expected_ids
  assert result.text == bpe.decode(expected_ids)


def test_the_passkey_task_is_rendered_then_tokenized_and_scored_on_the_key(bpe_run):
  hf_model, bpe, run, _ = bpe_run
  config = config_fields.load_saved(run)
  config.data.update(name="passkey", num_eval_examples=3, num_train_examples=2)
  config.train.seq_len = 120  # the byte-level BPE of 280 tokens merges little: ~90 without filler
  config.eval.update(lengths=(120,), depths=(0.5,))
  data.validate(config)
  data.prepare(config)
  row = extrapolation.evaluate_run(config, run, progress=lambda line: None)[0]  # depth 0.5
  assert row["depth"] == 0.5 and row["tokens"] == 3 * 5  # the 5 digits of each key, scored
  tokens, mask = storage.example_arrays(catalog.resolve(config), storage.data_dir(config),
                                        "validation_120_depth0")
  tokens, mask = np.asarray(tokens, np.int64), np.asarray(mask)
  assert tokens.shape == (3, 121) and tokens.dtype == np.int64
  for row_tokens, row_mask in zip(tokens, mask):
    text = bpe.decode(row_tokens.tolist())
    key = text.split("The pass key is ")[1][:5]
    assert key.isdigit() and text.endswith(f"What is the pass key? The pass key is {key}")
    # Exactly the answer's digits are scored (each a target: position i scores token i + 1).
    assert "".join(bpe.decode([t]) for t in row_tokens[1:][row_mask > 0]).strip() == key
  assert row["loss"] == pytest.approx(_scored_cross_entropy(hf_model, tokens, mask), rel=1e-5)


def test_an_imported_run_is_fine_tuned_from_its_parameters(bpe_run, tmp_path):
  from configs import finetune  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415
  from research.training import loop  # noqa: PLC0415
  _, _, run, _ = bpe_run
  config = finetune.get_config(run)
  assert config.train.init_from == run and config.model.swiglu.hidden == SIZES["intermediate_size"]
  config.train.update(num_steps=2, batch_size=8, seq_len=16, warmup_steps=1, checkpoint_every=2,
                      keep_checkpoints=3, log_every=1, eval_batches=1)
  workdir = str(tmp_path / "fine_tuned")
  loop.train_and_evaluate(config, workdir)
  fine_tuned = config_fields.load_saved(workdir)
  _, start = generate.restore(fine_tuned, workdir, step=0, log=lambda line: None)
  _, imported = generate.restore(config_fields.load_saved(run), run, log=lambda line: None)
  for (path, ours), (_, theirs) in zip(nnx.to_flat_state(nnx.state(start)),
                                       nnx.to_flat_state(nnx.state(imported))):
    np.testing.assert_array_equal(ours.get_value(), theirs.get_value(), err_msg=str(path))
  assert 2 in checkpoints.steps(workdir)
  # Its export gives back the imported checkpoint's special-token ids (LlamaConfig's defaults
  # here, not the BPE's end of sequence, 0), and the longer of 16 trained and 8 imported.
  hf = convert.export_run(workdir, str(tmp_path / "exported"), log=lambda line: None)
  assert (hf["bos_token_id"], hf["eos_token_id"], "pad_token_id" in hf) == (1, 2, False)
  assert hf["max_position_embeddings"] == 16


@pytest.mark.parametrize("model", [
    dict(attention="gqa", num_kv_heads=2, projection_bias="none", window=0),
    dict(attention="mha", num_kv_heads=4, projection_bias="qkv", window=0),
    dict(attention="gqa", num_kv_heads=2, projection_bias="none", window=6)])
def test_a_lab_run_exports_to_a_checkpoint_transformers_computes_alike(tmp_path, model):
  from flax import nnx  # noqa: PLC0415
  from research import defaults  # noqa: PLC0415
  from research.model import transformer as model_lib  # noqa: PLC0415
  config = defaults.get_config()
  config.model.update(attention=model["attention"], num_kv_heads=model["num_kv_heads"],
                      num_layers=2, d_model=32, num_heads=4, vocab_size=VOCAB,
                      feed_forward="swiglu", position="rope")
  config.model.softmax.update(projection_bias=model["projection_bias"], window=model["window"])
  lab_model = model_lib.build_model(config.model, rngs=nnx.Rngs(3))
  for path, variable in nnx.to_flat_state(nnx.state(lab_model)):  # biases start at zero
    if path[-1] == "bias":
      variable.set_value(jax.random.normal(jax.random.key(len(path)), variable.get_value().shape))
  run, exported = str(tmp_path / "run"), str(tmp_path / "hf")
  manager = checkpoints.manager(run, keep=1)
  checkpoints.save(manager, 0, {"params": nnx.state(lab_model)})
  checkpoints.wait(manager)
  with open(os.path.join(run, "config.json"), "w") as f:
    f.write(config.to_json())
  hf = convert.export_run(run, exported, log=lambda line: None)
  assert hf["model_type"] == ("mistral" if model["window"] else
                              {"none": "llama", "qkv": "qwen2"}[model["projection_bias"]])
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      exported, attn_implementation="eager").eval()
  tokens = _tokens(3)
  assert _relative_error(np.asarray(lab_model(jnp.asarray(tokens))),
                         _hf_logits(reloaded, tokens)) < 1e-5
  assert reloaded.config.max_position_embeddings == config.train.seq_len
  assert sorted(os.listdir(exported)) == ["config.json", "generation_config.json",
                                          "model.safetensors", "tokenizer.json",
                                          "tokenizer_config.json"]  # the byte-level tokenizer
  generation = transformers.GenerationConfig.from_pretrained(exported)
  assert (generation.eos_token_id, generation.pad_token_id, hf["eos_token_id"]) == (256, 257, 256)


def test_a_byte_level_run_exports_a_tokenizer_that_encodes_its_bytes(tmp_path):
  files = hf_tokenizer.export_files(tokenizer.ByteTokenizer())
  for name, content in files.items():
    (tmp_path / name).write_text(content)
  hf_tokens = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  text = f"héllo  wörld\n\t日本 {hf_tokenizer.BYTE_EOS}{hf_tokenizer.BYTE_PAD} \x00\x7f 🎉"
  ids = tokenizer.ByteTokenizer().encode(text).tolist()
  assert hf_tokens.encode(text, add_special_tokens=False) == ids == hf_tokens(text).input_ids
  assert (hf_tokens.eos_token_id, hf_tokens.pad_token_id, hf_tokens.bos_token_id) == (256, 257,
                                                                                      None)
  assert hf_tokens.decode(ids + [256, 257], skip_special_tokens=True) == text
  invalid = [0xff, 0x68, 0xe6, 0x97, 0x41]  # bytes that are no UTF-8: replaced alike
  assert hf_tokens.decode(invalid) == tokenizer.ByteTokenizer().decode(invalid)
  assert hf_tokenizer.special_ids(tokenizer.ByteTokenizer()) == {"eos_token_id": 256,
                                                                 "pad_token_id": 257}


def test_the_head_analyses_read_an_imported_run_and_label_its_tokens(bpe_run):
  from research.analysis import analyze  # noqa: PLC0415
  from research.analysis import base  # noqa: PLC0415
  _, bpe, run, _ = bpe_run
  settings = base.Settings(text="the rotary key value", num_sequences=1, length_factors=(1,))
  (out,) = analyze.analyze(run, ["attention_maps"], settings, log=lambda line: None)
  assert os.path.exists(os.path.join(out, "distance.csv")) and any(
      name.endswith(".png") for name in os.listdir(out))
  text_tokens = tokenizer.get(config_fields.load_saved(run))
  assert [text_tokens.label(t) for t in bpe.encode("the rotary").ids] == \
      bpe.encode("the rotary").tokens
