"""Training data (mtp_jax.train.data): JSONL reading, the eval split, batches and their resume
state, and self-generated continuations (against the numpy oracle's greedy tokens)."""

import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from mtp_jax.config import ConfigError
from mtp_jax.tokenizer import Tokenizer
from mtp_jax.train.data import Batches, read_jsonl, self_generate, split_eval
from tests.helpers.paths import fixture_path

WORDS = ["[UNK]", "hello", "world", "user:", "assistant:", "hi", "there"]
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def tok():
    hf = HFTokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    hf.pre_tokenizer = WhitespaceSplit()
    return Tokenizer(hf, chat_template=TEMPLATE)


def jsonl(tmp_path, *lines, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line)
                              for line in lines) + "\n")
    return str(path)


# ---- read_jsonl ------------------------------------------------------------------------------

def test_read_jsonl_every_kind(tmp_path, tok):
    path = jsonl(tmp_path, {"token_ids": [1, 2, 3]}, "", "   ", {"text": "hello world"},
                 {"prompt": "hi there", "temperature": 0.5},
                 {"prompt": [{"role": "user", "content": "hello"}]},
                 {"prompt": [{"role": "user", "content": "hi"},
                             {"role": "assistant", "content": "there"}]})
    assert read_jsonl(path, tok, vocab_size=7) == [
        [1, 2, 3], [1, 2], [5, 6],
        [3, 1, 4],      # "user: hello assistant:" (a generation prompt is added)
        [3, 5, 4, 6]]   # "user: hi assistant: there" (none after the assistant's turn)


@pytest.mark.parametrize("line, match", [
    ("{not json", r"line 2: not valid JSON"),
    ('{"tokens": [1]}', r"line 2: has keys \['tokens'\]; each line needs exactly one of"),
    ('{"text": "a", "token_ids": [1]}', r"line 2: has both token_ids and text"),
    ('{"token_ids": [1, "2"]}', r"line 2: token_ids must be a list of ints"),
    ('{"token_ids": [1, 9]}', r"line 2: token ids \[9\] are outside the vocabulary \[0, 7\)"),
    ('{"token_ids": []}', r"line 2: the sequence is empty"),
    ('[1, 2]', r"line 2: expected a JSON object"),
    ('{"prompt": [{"content": "x"}]}', r"line 2: a chat prompt is a non-empty list"),
])
def test_read_jsonl_errors_name_file_and_line(tmp_path, tok, line, match):
    path = jsonl(tmp_path, {"token_ids": [1]}, line)
    with pytest.raises(ConfigError, match=match) as e:
        read_jsonl(path, tok, vocab_size=7)
    assert path in str(e.value)


def test_read_jsonl_text_without_tokenizer(tmp_path):
    path = jsonl(tmp_path, {"text": "hello"})
    with pytest.raises(ConfigError, match=r"line 1: text needs a tokenizer.*token_ids"):
        read_jsonl(path, None)
    assert read_jsonl(jsonl(tmp_path, {"token_ids": [4]}, name="ids.jsonl"), None) == [[4]]
    with pytest.raises(ConfigError, match="cannot read the data file"):
        read_jsonl(str(tmp_path / "missing.jsonl"), None)
    with pytest.raises(ConfigError, match="holds no sequence"):
        read_jsonl(jsonl(tmp_path, "", name="blank.jsonl"), None)


# ---- split_eval ------------------------------------------------------------------------------

def test_split_eval():
    seqs = [[i] for i in range(20)]
    train, ev = split_eval(seqs, 0.25, seed=3)
    assert len(ev) == 5 and sorted(train + ev) == seqs
    assert train == sorted(train) and ev == sorted(ev)  # input order kept
    assert split_eval(seqs, 0.25, seed=3) == (train, ev)
    assert split_eval(seqs, 0.25, seed=4)[1] != ev
    assert split_eval(seqs[:2], 0.01, 0)[1] != [] and len(split_eval(seqs[:2], 0.9, 0)[0]) == 1
    assert split_eval(seqs, 0.0, 0) == (seqs, [])
    assert split_eval(seqs[:1], 0.5, 0) == (seqs[:1], [])
    with pytest.raises(ConfigError, match="eval fraction 1"):
        split_eval(seqs, 1, 0)


# ---- Batches ---------------------------------------------------------------------------------

SEQS = [list(range(100, 110)), list(range(200, 204)), [7, 8], list(range(300, 307))]
# seq_len 4: windows [100..103] [104..107] [108 109]-dropped; [200..203]; [7 8] dropped;
# [300..303] [304 305 306]
WINDOWS = [(100, 101, 102, 103), (104, 105, 106, 107), (200, 201, 202, 203),
           (300, 301, 302, 303), (304, 305, 306)]


def rows(batch):
    ids, lengths = batch
    assert ids.dtype == np.int32 and lengths.dtype == np.int32
    for r in range(ids.shape[0]):
        assert not ids[r, lengths[r]:].any()  # zero padding
    return [tuple(ids[r, :lengths[r]].tolist()) for r in range(ids.shape[0])]


def test_train_batches_shuffle_each_epoch_and_run_forever():
    b = Batches(SEQS, batch_size=2, seq_len=4, seed=1)
    assert b.num_windows == 5 and len(b) == 3
    it = iter(b)
    batches = [next(it) for _ in range(10)]  # 20 rows = 4 epochs of 5 windows
    assert all(x.ids.shape == (2, 4) and x.lengths.shape == (2,) for x in batches)
    stream = [r for x in batches for r in rows(x)]
    epochs = [stream[i:i + 5] for i in range(0, 20, 5)]
    assert all(sorted(e) == sorted(WINDOWS) for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1  # another order per epoch
    assert [r for x in list(zip(range(10), Batches(SEQS, 2, 4, seed=1)))
            for r in rows(x[1])] == stream  # deterministic in seed
    assert [r for _, x in zip(range(10), Batches(SEQS, 2, 4, seed=2)) for r in rows(x)] != stream


def test_train_state_resumes_where_it_stopped():
    a = Batches(SEQS, batch_size=3, seq_len=4, seed=5)
    for _ in range(4):
        a.next_batch()
    state = json.loads(json.dumps(a.state()))
    expected = [rows(a.next_batch()) for _ in range(3)]
    b = Batches(SEQS, batch_size=3, seq_len=4, seed=5)
    b.restore(state)
    assert [rows(b.next_batch()) for _ in range(3)] == expected
    with pytest.raises(ConfigError, match="5 windows, this data has 3"):
        Batches(SEQS[1:], 3, 4, seed=5).restore(state)
    with pytest.raises(ConfigError, match="malformed"):
        b.restore({"epoch": 1})


def test_eval_batches_one_pass_in_order_padded():
    b = Batches(SEQS, batch_size=2, seq_len=4, train=False)
    batches = list(b)
    assert len(batches) == 3 == len(b)
    got = [r for x in batches for r in rows(x)]
    assert got == WINDOWS + [()]  # the last row pads: length 0
    assert [rows(x) for x in b] == [rows(x) for x in batches]  # every pass the same


def test_batches_refusals():
    with pytest.raises(ConfigError, match="has 3 tokens or more"):
        Batches([[1, 2], [3]], 2, 8)
    with pytest.raises(ConfigError, match="sequence length 2"):
        Batches(SEQS, 2, 2)


# ---- self_generate ---------------------------------------------------------------------------

class FakeLLM:
    """Records the call; answers each prompt with ids from its sampling seed."""

    def __init__(self, error_at=None):
        self.calls, self.error_at = [], error_at

    def generate(self, prompts, params):
        from types import SimpleNamespace
        self.calls.append((prompts, params))
        return [SimpleNamespace(token_ids=[p.seed] * p.max_tokens,
                                finish_reason="error" if i == self.error_at else "length",
                                error="too long") for i, p in enumerate(params)]


def test_self_generate_one_call_per_prompt_seeds():
    llm = FakeLLM()
    out = self_generate(llm, [[1, 2], [3]], max_new_tokens=2, temperature=0.7, seed=10)
    assert out == [[1, 2, 10, 10], [3, 11, 11]]
    assert len(llm.calls) == 1
    assert [(p.temperature, p.max_tokens) for p in llm.calls[0][1]] == [(0.7, 2)] * 2
    with pytest.raises(ConfigError, match="prompt 1 .* refused by the engine: too long"):
        self_generate(FakeLLM(error_at=1), [[1], [2]], 2, 0.0, 0)
    with pytest.raises(ValueError, match="temperature"):
        self_generate(FakeLLM(), [[1]], 2, -1.0, 0)
    assert self_generate(FakeLLM(), [], 2, 0.0, 0) == []


def test_self_generate_greedy_matches_the_oracle():
    from mtp_jax import LLM

    golden = np.load(os.path.join(fixture_path("tiny_dense"), "golden.npz"))
    prompts = golden["input_ids"].tolist()
    llm = LLM(fixture_path("tiny_dense"), dtype="float32", speculative_algorithm="none",
              max_running_requests=2, max_model_len=64, max_total_tokens=256,
              enable_prefix_cache=False, overlap_schedule=False)
    n = golden["greedy_tokens"].shape[1]
    out = self_generate(llm, prompts, max_new_tokens=n, temperature=0.0, seed=0)
    assert out == [p + g for p, g in zip(prompts, golden["greedy_tokens"].tolist())]
