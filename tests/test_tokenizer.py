"""Tokenizers: the built-in char tokenizer and HF tokenizer.json loading (no downloads)."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from hexrl.data.tokenizer import MATH_INSTRUCTION, SYSTEM_PROMPT, CharTokenizer, HFTokenizer, load_tokenizer
from hexrl.data.tokenizer import Tokenizer as TokenizerProtocol

# ----------------------------------------------------------------------------- char


def test_char_round_trip_and_specials():
    tok = CharTokenizer()
    text = "12+7=19\nabc? (3*4)-5"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert min(ids) >= 3  # 0, 1, 2 are reserved
    assert tok.decode(ids) == text
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 3 + len(tok.alphabet)
    # specials vanish on decode, as they do for HF tokenizers with skip_special_tokens
    assert tok.decode([tok.bos_id] + tok.encode("1+1=") + [tok.eos_id, tok.pad_id]) == "1+1="
    assert isinstance(tok, TokenizerProtocol)


def test_char_unknown_character_is_named():
    tok = CharTokenizer("0123456789+=")
    with pytest.raises(ValueError, match=r"\['X', 'é'\]"):
        tok.encode("1+X=é")


def test_char_duplicate_alphabet_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        CharTokenizer("0123+1")


def test_char_serialisation(tmp_path):
    tok = CharTokenizer("0123456789+-=\n")
    again = CharTokenizer.from_json(tok.to_json())
    assert again.alphabet == tok.alphabet
    assert again.encode("12+3=") == tok.encode("12+3=")
    path = tok.save(tmp_path / "ckpt")
    assert path.name == "hexrl_tokenizer.json"
    loaded = load_tokenizer(tmp_path / "ckpt")
    assert isinstance(loaded, CharTokenizer) and loaded.alphabet == tok.alphabet
    with pytest.raises(ValueError, match="not a CharTokenizer"):
        CharTokenizer.from_json(json.dumps({"type": "bpe"}))


def test_char_chat_prompt_is_identity():
    assert CharTokenizer().chat_prompt("12+7=") == "12+7="


def test_load_tokenizer_by_name():
    assert isinstance(load_tokenizer("char"), CharTokenizer)


# ----------------------------------------------------------------------------- HF

CORPUS = ["hello world", "the answer is 42", "reason step by step", "put the final answer in a box"] * 20


def _make_hf_dir(tmp_path, specials, tok_cfg=None, gen_cfg=None, cfg=None):
    """Train a tiny BPE tokenizer locally and write it as a HF checkpoint's tokenizer files."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]"] + specials))
    tmp_path.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    for name, data in (("tokenizer_config.json", tok_cfg), ("generation_config.json", gen_cfg), ("config.json", cfg)):
        if data is not None:
            (tmp_path / name).write_text(json.dumps(data))
    return tok


QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_hf_loads_and_matches_raw_tokenizer(tmp_path):
    raw = _make_hf_dir(tmp_path, QWEN_SPECIALS, tok_cfg={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    text = "the answer is 42"
    assert tok.encode(text) == raw.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == raw.decode(raw.encode(text).ids)
    assert tok.eos_id == raw.token_to_id("<|im_end|>")
    assert tok.pad_id == raw.token_to_id("<|endoftext|>")
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True)
    # a special token written in a prompt becomes its single id
    assert tok.encode("<|im_start|>hello")[0] == raw.token_to_id("<|im_start|>")


def test_hf_eos_from_generation_config_list_and_config(tmp_path):
    raw = _make_hf_dir(tmp_path / "a", QWEN_SPECIALS, gen_cfg={"eos_token_id": [7, 8]})
    tok = HFTokenizer(tmp_path / "a")
    assert tok.eos_id == 7 and tok.stop_ids == [7, 8]
    assert tok.pad_id == 7  # no pad token: falls back to eos
    _make_hf_dir(tmp_path / "b", QWEN_SPECIALS, cfg={"eos_token_id": 5})
    assert HFTokenizer(tmp_path / "b").eos_id == 5
    # tokenizer_config's eos_token (dict form) comes first, generation_config ids follow
    _make_hf_dir(tmp_path / "c", QWEN_SPECIALS, tok_cfg={"eos_token": {"content": "<|im_end|>"}},
                 gen_cfg={"eos_token_id": [raw.token_to_id("<|endoftext|>")]})
    tok_c = HFTokenizer(tmp_path / "c")
    assert tok_c.stop_ids == [raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>")]


def test_hf_eos_missing_is_an_error(tmp_path):
    _make_hf_dir(tmp_path, [])
    with pytest.raises(ValueError, match="eos"):
        HFTokenizer(tmp_path)


def test_hf_missing_tokenizer_json_names_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="hexrl_tokenizer.json"):
        load_tokenizer(tmp_path)  # an empty directory
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_qwen_chat_prompt_matches_transformers_template(tmp_path):
    transformers = pytest.importorskip("transformers")
    _make_hf_dir(tmp_path, QWEN_SPECIALS, tok_cfg={"eos_token": "<|im_end|>", "chat_template": CHATML})
    tok = HFTokenizer(tmp_path)
    assert tok.chat_style == "qwen"
    question = "What is 2+3?"
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=CHATML)
    expected = ref.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT},
         {"role": "user", "content": f"{question}\n{MATH_INSTRUCTION}"}], tokenize=False, add_generation_prompt=True)
    assert tok.chat_prompt(question) == expected
    assert "\\boxed{}" in expected


def test_llama3_and_plain_chat_prompts(tmp_path):
    llama = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    _make_hf_dir(tmp_path / "llama", llama, tok_cfg={"eos_token": "<|eot_id|>"})
    prompt = HFTokenizer(tmp_path / "llama").chat_prompt("Q?")
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert "<|start_header_id|>user<|end_header_id|>\n\nQ?\n" in prompt
    assert prompt.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    _make_hf_dir(tmp_path / "plain", ["</s>"])
    plain = HFTokenizer(tmp_path / "plain")
    assert plain.chat_style == "plain" and plain.chat_prompt("Q?") == "Q?\n"
    assert plain.eos_id == plain.raw.token_to_id("</s>")  # conventional-name fallback
