"""The HTTP process's tokenizer without transformers (#48): the `tokenizers` library on
tokenizer.json, the chat template rendered by chat_render.py.

transformers (with numpy, huggingface_hub, PIL, ...) held ~34 MiB of the HTTP process for a
tokenizer that is the Rust one plus a chat template. `thin_tokenizer(folder)` builds that
directly where the folder is one it can reproduce exactly; else it says why and the caller
loads transformers (tokenizer.load_tokenizer logs which one serves). Exactly means: a
tokenizer_config.json naming the generic backend (TokenizersBackend / PreTrainedTokenizerFast),
no key outside the ones whose effect is reproduced here (add_bos_token, add_prefix_space, a
split_special_tokens, legacy files... go to transformers), every special and added token of the
config already in tokenizer.json with the same flags (transformers would add or change it), a
base vocabulary of at most 100,000 (transformers may patch Mistral's pre-tokenizer above that),
and `clean_up_tokenization_spaces` off or a BPE model (where transformers ignores it).
tests/engine/test_thin_tokenizer.py holds it to transformers' ids, text and chat prompts."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from pdcore.engine.model import chat_render

SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                 "mask_token")
# tokenizer_config.json keys whose effect this class reproduces (or that have none on encoding)
_KNOWN = {"tokenizer_class", "backend", "added_tokens_decoder", "chat_template",
          "chat_control_tokens", "clean_up_tokenization_spaces", "model_max_length",
          "padding_side", "truncation_side", "model_input_names", "is_local",
          "local_files_only", "extra_special_tokens", "additional_special_tokens",
          "name_or_path", "errors", *SPECIAL_ATTRS}
_GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")
_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
_LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json", "additional_chat_templates")


def _content(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _why_not(folder: str, cfg: dict[str, Any], backend: Any) -> str | None:
    """Why `folder` needs transformers, or None."""
    if cfg.get("tokenizer_class") not in _GENERIC:
        return f"tokenizer_class {cfg.get('tokenizer_class')!r}"
    extra = sorted(k for k in cfg if k not in _KNOWN and not (
        k == "split_special_tokens" and cfg[k] is False))
    if extra:
        return f"tokenizer_config.json keys {extra}"
    legacy = [f for f in _LEGACY_FILES if os.path.exists(os.path.join(folder, f))]
    if legacy:
        return f"files {legacy}"
    if backend.get_vocab_size(with_added_tokens=False) > 100_000:
        return "a vocabulary over 100,000 (transformers may patch its pre-tokenizer)"
    if cfg.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return "clean_up_tokenization_spaces on a non-BPE model"
    added = backend.get_added_tokens_decoder()
    by_content = {t.content: t for t in added.values()}
    for i, spec in (cfg.get("added_tokens_decoder") or {}).items():
        have = added.get(int(i))
        if have is None or any(spec.get(f, getattr(have, f)) != getattr(have, f)
                               for f in _FLAGS):
            return f"added token {i} {spec.get('content')!r} differs from tokenizer.json's"
    extras = cfg.get("extra_special_tokens", cfg.get("additional_special_tokens")) or []
    if not isinstance(extras, list):
        return "extra_special_tokens as a mapping"
    for v in [cfg.get(a) for a in SPECIAL_ATTRS] + extras:
        if v is None:
            continue
        c = _content(v)
        if c is None or c not in by_content or not by_content[c].special:
            return f"special token {c!r} is not a special added token of tokenizer.json"
    return None


def thin_tokenizer(folder: str) -> tuple[ThinTokenizer | None, str]:
    """(the tokenizer, "") or (None, why transformers is needed)."""
    cfg_path, tok_path = (os.path.join(folder, f) for f in ("tokenizer_config.json",
                                                               "tokenizer.json"))
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"no readable tokenizer_config.json ({type(e).__name__})"
    if not isinstance(cfg, dict) or not os.path.isfile(tok_path):
        return None, "no tokenizer.json"
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(tok_path)
    why = _why_not(folder, cfg, backend)
    if why:
        return None, why
    template: Any = cfg.get("chat_template")
    jinja = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja):  # the file wins over the config's entry, as in transformers
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    elif isinstance(template, list):  # named templates
        template = {t["name"]: t["template"] for t in template}
    return ThinTokenizer(folder, backend, cfg, template), ""


class ThinTokenizer:
    """The part of transformers' tokenizer API the server uses, on a `tokenizers.Tokenizer`."""

    is_fast = True

    def __init__(self, folder: str, backend: Any, cfg: dict[str, Any], chat_template: Any
                 ) -> None:
        backend.no_truncation()  # transformers encodes without either unless asked
        backend.no_padding()
        backend.encode_special_tokens = False
        self._tok, self._cfg = backend, cfg
        self.name_or_path = folder
        self.chat_template = chat_template
        self.chat_control_tokens = cfg.get("chat_control_tokens")
        self.clean_up_tokenization_spaces = bool(cfg.get("clean_up_tokenization_spaces"))
        self.special_tokens_map = {a: _content(cfg[a]) for a in SPECIAL_ATTRS
                                   if cfg.get(a) is not None}
        for a in SPECIAL_ATTRS:
            setattr(self, a, self.special_tokens_map.get(a))
            setattr(self, a + "_id", None if getattr(self, a) is None  # all added tokens
                    else backend.token_to_id(getattr(self, a)))
        extras = cfg.get("extra_special_tokens", cfg.get("additional_special_tokens")) or []
        self.extra_special_tokens = [_content(v) for v in extras]
        seen: list[str] = []
        for t in [*self.special_tokens_map.values(), *self.extra_special_tokens]:
            if t not in seen:
                seen.append(t)
        self.all_special_tokens = seen
        self.all_special_ids = [self.convert_tokens_to_ids(t) for t in seen]
        self.added_tokens_decoder = backend.get_added_tokens_decoder()
        self.added_tokens_encoder = {t.content: i for i, t in
                                     sorted(self.added_tokens_decoder.items())}
        self._newline_ids = self.encode("\n", add_special_tokens=False)

    def __repr__(self) -> str:
        return f"ThinTokenizer({self.name_or_path!r}, vocab {len(self)})"

    # -- vocabulary -------------------------------------------------------------------------
    @property
    def backend_tokenizer(self) -> Any:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self.added_tokens_encoder)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        if isinstance(tokens, str):
            i = self._tok.token_to_id(tokens)
            return self.unk_token_id if i is None else i
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False
                              ) -> Any:
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tok.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        dec = self._tok.decoder
        return dec.decode(tokens) if dec is not None else " ".join(tokens)

    # -- encoding ---------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True, **_: Any) -> dict[str, Any]:
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def _encode_plain(self, text: str) -> list[int]:
        """`text` through normalizer, pre-tokenizer and model only: no added token matched."""
        if self._tok.normalizer is not None:
            text = self._tok.normalizer.normalize_str(text)
        splits = [text] if self._tok.pre_tokenizer is None else \
            [s for s, _ in self._tok.pre_tokenizer.pre_tokenize_str(text)]
        return [t.id for s in splits for t in self._tok.model.tokenize(s)]

    def decode(self, ids: Any, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None, **_: Any) -> str:
        # clean-up is never applied: off in the config, or ignored on BPE (as transformers)
        if isinstance(ids, int):
            ids = [ids]
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError("This model has multiple chat templates with no default "
                                 f"specified; template names: {sorted(own)}.")
        if chat_template is None:
            if own is None:
                raise ValueError("Cannot use chat template functions because "
                                 "tokenizer.chat_template is not set and no template argument "
                                 "was passed!")
            return own
        return chat_template

    def _control_tokens(self, template: str) -> tuple[str, ...]:
        listed = set(self.chat_control_tokens) if self.chat_control_tokens is not None else None
        text = chat_render.literal_text(template) if listed is None else ""
        return tuple(t.content for t in self.added_tokens_decoder.values() if t.special or (
            t.content in listed if listed is not None
            else t.content in text and not t.content.isspace()))

    def _encode_marked(self, chat: str) -> list[int]:
        pieces = chat_render.marked_pattern(tuple(self.added_tokens_encoder)).split(chat)
        ids = self.encode(pieces[0], add_special_tokens=False)
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            as_text = i % 2 == 1  # the marked tokens: plain text
            enc = self._encode_plain if as_text else \
                (lambda s: self.encode(s, add_special_tokens=False))
            got = enc("\n" + piece)  # after a newline: no SentencePiece prefix space
            n = len(self._newline_ids)
            got = got[n:] if got[:n] == self._newline_ids else enc(piece)
            if as_text and self.convert_tokens_to_ids(piece) in got:
                raise ValueError(f"Can't sanitize {piece!r}: the tokenizer produces it from "
                                 "plain text")
            ids += got
        return ids

    def apply_chat_template(self, conversation: Any, tools: Any = None, *, documents: Any = None,
                            chat_template: str | None = None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True,
                            sanitize_control_tokens: bool = False, return_dict: bool = True,
                            **kwargs: Any) -> Any:
        for k in ("padding", "truncation", "max_length", "return_tensors",
                  "return_assistant_tokens_mask", "tokenizer_kwargs"):
            if kwargs.pop(k, None):
                raise NotImplementedError(f"ThinTokenizer.apply_chat_template: {k}")
        template = self.get_chat_template(chat_template, tools)
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at "
                             "least one message.")
        batched = isinstance(conversation, (list, tuple)) and (
            isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"))
        chats = [chat_render.normalize(c) for c in (conversation if batched else [conversation])]
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt are not "
                             "compatible.")
        if sanitize_control_tokens:
            if not tokenize:
                raise ValueError("`sanitize_control_tokens=True` requires `tokenize=True`")
            pat = chat_render.token_pattern(self._control_tokens(template))
            chats = [chat_render.mark(c, pat) for c in chats]
            tools, documents, kwargs = (chat_render.mark(x, pat) for x in (tools, documents,
                                                                             kwargs))
        variables = {**self.special_tokens_map, **kwargs}
        texts = [chat_render.render(template, c, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    variables=variables) for c in chats]
        if not tokenize:
            return texts if batched else texts[0]
        enc = self._encode_marked if sanitize_control_tokens else \
            (lambda s: self.encode(s, add_special_tokens=False))
        ids = [enc(t) for t in texts]
        if not return_dict:
            return ids if batched else ids[0]
        masks = [[1] * len(x) for x in ids]
        return {"input_ids": ids if batched else ids[0],
                "attention_mask": masks if batched else masks[0]}

    # -- files ------------------------------------------------------------------------------
    def save_pretrained(self, dest: str) -> tuple[str, ...]:
        """tokenizer.json and tokenizer_config.json as loaded, the chat template (as set now)
        in chat_template.jinja: a folder this class and transformers load alike."""
        os.makedirs(dest, exist_ok=True)
        shutil.copyfile(os.path.join(self.name_or_path, "tokenizer.json"),
                        os.path.join(dest, "tokenizer.json"))
        cfg = {k: v for k, v in self._cfg.items() if k != "chat_template"}
        files = [os.path.join(dest, "tokenizer.json"), os.path.join(dest, "tokenizer_config.json")]
        if isinstance(self.chat_template, dict):
            cfg["chat_template"] = [{"name": k, "template": v}
                                    for k, v in self.chat_template.items()]
        elif self.chat_template is not None:
            files.append(os.path.join(dest, "chat_template.jinja"))
            with open(files[-1], "w", encoding="utf-8") as f:
                f.write(self.chat_template)
        with open(files[1], "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)
        return tuple(files)
