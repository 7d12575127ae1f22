"""Each family's chat format through `LLM.chat` and the server: the tokenizer's own template
renders the conversation (real template strings, written into the tiny models'
tokenizer_config), and generation stops at the family's end-of-turn token, read from
generation_config.json's eos_token_id list as real checkpoints ship it."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedllm import LLM, SamplingParams

QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim"
    " + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

# family -> (template, special tokens the tokenizer needs, the end-of-turn token, the rendered
# prompt of CONVERSATION as the family's format writes it).
FORMATS = {
    "qwen3": (QWEN3_TEMPLATE, [], "<|im_end|>",
              "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"),
    "qwen3_moe": (QWEN3_TEMPLATE, [], "<|im_end|>",
                  "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"),
    "gemma2": (GEMMA_TEMPLATE, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>",
               "<|im_start|><start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\n"),
    "gemma3": (GEMMA_TEMPLATE, ["<start_of_turn>", "<end_of_turn>"], "<end_of_turn>",
               "<|im_start|><start_of_turn>user\nHello there<end_of_turn>\n<start_of_turn>model\n"),
    "phi3": (PHI3_TEMPLATE, ["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"], "<|end|>",
             "<|user|>\nHello there<|end|>\n<|assistant|>\n"),
    # Mistral's turns end at EOS (the default tokenizer's is <|im_end|>).
    "mixtral": (MISTRAL_TEMPLATE, [], "<|im_end|>", "<|im_start|>[INST] Hello there [/INST]"),
}
CONVERSATION = [{"role": "user", "content": "Hello there"}]
ROOM = 8  # vocabulary rows beyond the default tokenizer's, for the added special tokens


@pytest.fixture(scope="module")
def chat_model(tiny_models, tmp_path_factory):
    """family -> a tiny model folder whose tokenizer carries the family's chat template and
    special tokens, and whose generation_config.json stops at EOS and the end of turn."""
    from transformers import AutoTokenizer

    from tests.helpers import TINY_VOCAB

    built = {}

    def build(family: str):
        if family in built:
            return built[family]
        template, specials, end_of_turn, _ = FORMATS[family]
        folder = tmp_path_factory.mktemp(f"chat-{family}")
        shutil.copytree(tiny_models(family, vocab_size=TINY_VOCAB + ROOM), folder, dirs_exist_ok=True)
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        if specials:
            tokenizer.add_special_tokens({"additional_special_tokens": specials})
        tokenizer.chat_template = template
        tokenizer.save_pretrained(str(folder))
        eot = tokenizer.convert_tokens_to_ids(end_of_turn)
        config = json.loads((folder / "config.json").read_text())
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [config["eos_token_id"], eot]}))
        built[family] = folder, eot
        return built[family]

    return build


@pytest.mark.parametrize("family", FORMATS)
def test_chat_renders_the_family_template_and_stops_at_its_end_of_turn(chat_model, family):
    folder, eot = chat_model(family)
    llm = LLM(str(folder), max_model_len=128, num_gpu_blocks=32)
    try:
        assert eot in llm.llm_engine.eos_token_ids  # read from generation_config.json
        tokenizer = llm.get_tokenizer()
        # The end of turn made certain: the model's first token stops the reply.
        params = SamplingParams(temperature=0, max_tokens=8, logit_bias={eot: 100.0})
        out = llm.chat(CONVERSATION, params, use_tqdm=False)[0]
        assert tokenizer.decode(out.prompt_token_ids) == FORMATS[family][3]
        assert out.outputs[0].token_ids == [eot] and out.outputs[0].finish_reason == "stop"
        assert out.outputs[0].text == ""  # a special token, not shown
        # Without the bias the reply runs to max_tokens (the tiny model never picks the token).
        free = llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
        assert eot not in free.token_ids[:-1]
    finally:
        llm.llm_engine.shutdown()


def test_a_model_without_a_chat_template_says_so(tiny_models, tmp_path):
    """OPT's tokenizers ship no chat template: chat() names the way out instead of guessing one."""
    shutil.copytree(tiny_models("opt"), tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), max_model_len=128, num_gpu_blocks=32)
    try:
        with pytest.raises(ValueError, match="no chat template; use generate"):
            llm.chat(CONVERSATION, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


def test_the_server_stops_a_chat_reply_at_the_end_of_turn(chat_model):
    import openai
    from transformers import AutoTokenizer

    from pagedllm.cli import build_parser
    from tests.server.common import SERVE_FLAGS, start_server_thread

    folder, eot = chat_model("gemma3")
    args = build_parser().parse_args(["serve", str(folder), "--port", "0", *SERVE_FLAGS])
    server, thread, url = start_server_thread(args)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="tiny", messages=CONVERSATION, max_tokens=8, temperature=0,
                                               logit_bias={str(eot): 100})
        assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == ""
        assert reply.usage.completion_tokens == 1
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        assert reply.usage.prompt_tokens == len(tokenizer.encode(FORMATS["gemma3"][3], add_special_tokens=False))
    finally:
        server.should_exit = True
        thread.join(30)
