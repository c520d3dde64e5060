"""The frontend's tokenizer: a folder naming the generic `tokenizers` backend loads it directly
(no AutoTokenizer, hence no torch in the HTTP process) and it is the same tokenizer."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

from transformers import AutoTokenizer

from pdcore.engine.model.gguf_cache import converted
from pdcore.engine.model.tokenizer import _light_tokenizer, load_tokenizer, resolve_model

TEXTS = ["hello world", "The history of the printing press <|im_end|> and more",
         "  spaces\n\nnew lines\tand tabs", "émigré 東京 🙂"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


def test_light_tokenizer_is_autotokenizers() -> None:
    folder = converted(resolve_model(None)).path  # the default model's cached HF folder
    light, auto = _light_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    assert light is not None and type(light) is type(auto)
    for t in TEXTS:
        assert light.encode(t) == auto.encode(t)
        assert light.decode(light.encode(t)) == auto.decode(auto.encode(t))
    assert (light.apply_chat_template(CHAT, add_generation_prompt=True)
            == auto.apply_chat_template(CHAT, add_generation_prompt=True))
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids",
                 "chat_template"):
        assert getattr(light, attr) == getattr(auto, attr), attr


def test_frontend_tokenizer_does_not_import_torch() -> None:
    code = ("import sys; from types import SimpleNamespace as N; "
            "from pdcore.engine.model.tokenizer import load_tokenizer; "
            "t = load_tokenizer(N(model_path=None)); assert t.encode('hi'); "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, check=True)
    assert r.stdout.strip().splitlines()[-1] == "False", r.stderr[-2000:]


def test_chat_template_flag_still_applies(tmp_path) -> None:
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tok = load_tokenizer(SimpleNamespace(model_path=None, chat_template=str(tpl)))
    assert tok.apply_chat_template(CHAT, tokenize=False) == "[Be brief.][hi]"
