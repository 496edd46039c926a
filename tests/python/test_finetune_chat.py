"""Chat masking (moe8.finetune.chat) with real chat templates other than Qwen3's, applied to the shared Qwen3
tokenizer with the template family's special tokens added: Mixtral-Instruct's [INST] format (the system prompt
folded into the first user turn) and Llama 3's header format. The expected text of each conversation is written
out here by hand from the format (an independent reference, not the template), and every assistant reply must be
labelled exactly once, at its own position, with everything else -100: replies that also occur in the system
prompt, a user turn or a header, an empty reply, a conversation that opens with an assistant turn or ends with a
user turn, and the matched-turn counts the code reports. A template's refusal (Mixtral's alternation check) is a
clear error naming the conversation."""

import json

import pytest

pytest.importorskip("transformers", minversion="5.0", reason="moe8 finetune needs transformers>=5")

from moe8.finetune.chat import IGNORE, tokenize_chat  # noqa: E402
from moe8.finetune.config import Config, FinetuneError  # noqa: E402
from moe8.finetune.data import byte_tokenizer, load_tokenizer, shared, tokenize  # noqa: E402

QWEN3 = shared("tokenizers", "qwen3")
needs_qwen3 = pytest.mark.skipif(
    QWEN3 is None,
    reason="no shared Qwen3 tokenizer (tokenizers/qwen3 under MOE8_SHARED_DATA or ../shared/data)",
)

# The chat_template of mistralai/Mixtral-8x7B-Instruct-v0.1's tokenizer_config.json (Hugging Face Hub), verbatim.
MIXTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""  # noqa: E501

# The chat_template of meta-llama/Meta-Llama-3-8B-Instruct's tokenizer_config.json (Hugging Face Hub), verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def mixtral_text(chat):
    """The Mixtral-Instruct format by hand: <s>, ' [INST] ' (system + blank line, first turn only) user ' [/INST]',
    ' ' reply '</s>'."""
    system = chat[0]["content"] if chat and chat[0]["role"] == "system" else None
    out = "<s>"
    for k, m in enumerate(chat[1:] if system is not None else chat):
        if m["role"] == "user":
            out += (
                " [INST] "
                + (system + "\n\n" if k == 0 and system is not None else "")
                + m["content"]
                + " [/INST]"
            )
        else:
            out += " " + m["content"] + "</s>"
    return out


def llama3_text(chat):
    """The Llama 3 format by hand: <|begin_of_text|>, then per message a role header, the stripped content and
    <|eot_id|>."""
    head = "<|start_header_id|>{}<|end_header_id|>\n\n"
    return "<|begin_of_text|>" + "".join(
        head.format(m["role"]) + m["content"].strip() + "<|eot_id|>" for m in chat
    )


FAMILIES = {
    # template, special tokens the family's tokenizer has, the format by hand, the generation prompt by hand
    "mixtral": (MIXTRAL, dict(bos_token="<s>", eos_token="</s>"), mixtral_text, ""),
    "llama3": (
        LLAMA3,
        dict(
            bos_token="<|begin_of_text|>",
            eos_token="<|eot_id|>",
            additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"],
        ),
        llama3_text,
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
}


def family_tokenizer(name):
    template, special, text, prompt = FAMILIES[name]
    tok = load_tokenizer(Config(tokenizer="qwen3"), None)
    tok.add_special_tokens(special)
    tok.chat_template = template
    return tok, text, prompt


def spans(ids, labels):
    """[start, end) runs of labelled tokens; each label equals its token."""
    assert len(ids) == len(labels)
    out, start = [], None
    for t, (x, y) in enumerate(zip(ids, labels)):
        if y != IGNORE:
            assert y == x, f"label {y} at {t} is not the token {x}"
            start = t if start is None else start
        elif start is not None:
            out.append((start, t))
            start = None
    return out + ([(start, len(ids))] if start is not None else [])


def expected_runs(chat, text, prompt):
    """(text before the reply, the reply's labelled text) per assistant turn, by hand: the reply starts where the
    conversation so far plus the generation prompt ends."""
    out = []
    for i, m in enumerate(chat):
        if m["role"] == "assistant":
            before = (text(chat[:i]) if i else text([])) + prompt
            full = text(chat[: i + 1])
            assert full.startswith(before)
            out.append((before, full[len(before) :]))
    return out


def hard_chat(header_word):
    return [
        {"role": "system", "content": "Answer politely. Never say " + header_word + "."},
        {"role": "user", "content": "Say politely."},
        {"role": "assistant", "content": "politely."},  # also in the system prompt and the user turn
        {"role": "user", "content": "Now say nothing."},
        {"role": "assistant", "content": ""},  # an empty reply: its closing token is still trained
        {"role": "user", "content": "Say " + header_word + "."},
        {"role": "assistant", "content": header_word},  # the template's own header text
        {"role": "user", "content": "Bye."},  # a final user turn: no loss, not in the document
    ]


@needs_qwen3
@pytest.mark.parametrize("name", FAMILIES)
def test_each_reply_labelled_once_at_its_position(name):
    tok, text, prompt = family_tokenizer(name)
    header_word = "[INST]" if name == "mixtral" else "assistant"
    chat = hard_chat(header_word)
    docs, stats = tokenize_chat(tok, chat)
    assert (stats.turns, stats.matched, stats.split, stats.unmatched_examples) == (3, 3, 0, [])
    [(ids, labels)] = docs  # neither template rewrites earlier turns: one document
    assert tok.decode(ids) == text(chat[:-1])  # the template's rendering, up to the last assistant turn
    want = expected_runs(chat, text, prompt)
    got = spans(ids, labels)
    assert len(got) == len(want) == 3
    for (start, end), (before, reply) in zip(got, want):
        assert tok.decode(ids[:start]) == before  # exactly at the reply's position, not where its text recurs
        assert tok.decode(ids[start:end]) == reply
    assert tok.decode(ids[slice(*got[1])]) in (" </s>", "<|eot_id|>")  # the empty reply: its closing token
    # no system prompt; with Llama 3 a conversation that opens with an assistant turn (labelled without its
    # header: transformers renders no empty conversation to take a generation prompt from); Mixtral's template
    # refuses that (roles must alternate from a user turn)
    chat = [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello, ask me."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
    ][1 if name == "llama3" else 0 :]
    docs, stats = tokenize_chat(tok, chat)
    [(ids, labels)] = docs
    assert (stats.turns, stats.matched) == (sum(m["role"] == "assistant" for m in chat),) * 2
    want = expected_runs(chat, text, prompt)
    assert [(tok.decode(ids[:s]), tok.decode(ids[s:e])) for s, e in spans(ids, labels)] == want
    # a conversation of user turns only: nothing to train on
    docs, stats = tokenize_chat(tok, [{"role": "user", "content": "Hi."}])
    assert docs == [] and (stats.turns, stats.matched) == (0, 0)


@needs_qwen3
def test_template_refusal_is_an_error_naming_the_conversation(tmp_path):
    tok, _, _ = family_tokenizer("mixtral")
    good = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    bad = [{"role": "user", "content": "Hi."}, {"role": "user", "content": "Hello?"}, good[1]]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in (good, bad)))
    with pytest.raises(FinetuneError) as e:
        tokenize(Config(), tok, str(path))
    msg = str(e.value)
    assert "conversation 2 (roles user, user, assistant)" in msg and "roles must alternate" in msg
    assert str(path) in msg


def test_opening_assistant_turn_without_its_header():
    """ChatML (the byte tokenizer's template, no shared data needed): an assistant turn that opens the
    conversation is labelled from its content on, as a later one is; the header is the prompt's."""
    tok = byte_tokenizer()
    chat = [
        {"role": "assistant", "content": "assistant here"},  # the reply repeats the header's role name
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": ""},
    ]
    docs, stats = tokenize_chat(tok, chat)
    [(ids, labels)] = docs
    assert (stats.turns, stats.matched) == (2, 2)
    text = "<|im_start|>assistant\nassistant here<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids) == text + "<|im_end|>\n"
    got = [(tok.decode(ids[:s]), tok.decode(ids[s:e])) for s, e in spans(ids, labels)]
    assert got == [("<|im_start|>assistant\n", "assistant here<|im_end|>"), (text, "<|im_end|>")]


@needs_qwen3
def test_opening_assistant_turn_qwen3():
    """Qwen3's own template: the opening turn as it renders it (no <think> block: no user turn precedes it),
    the later one with its empty <think> block; one document (the first turn is not rewritten)."""
    tok = load_tokenizer(Config(tokenizer="qwen3"), None)
    chat = [
        {"role": "assistant", "content": "assistant"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    docs, stats = tokenize_chat(tok, chat)
    [(ids, labels)] = docs
    assert (stats.turns, stats.matched, stats.split) == (2, 2, 0)
    first = "<|im_start|>assistant\n"
    second = first + "assistant<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    got = [(tok.decode(ids[:s]), tok.decode(ids[s:e])) for s, e in spans(ids, labels)]
    assert got == [(first, "assistant<|im_end|>"), (second, "<think>\n\n</think>\n\n4<|im_end|>")]
