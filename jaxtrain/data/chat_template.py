"""Chat templates: a model's own (the Jinja `chat_template` of its Hugging Face tokenizer files) or a built-in one,
rendered as transformers' `apply_chat_template` renders them.

Where a template comes from (`find_chat_template`), in order:

- `--chat-template NAME`: a built-in template (`BUILTIN_TEMPLATES`: `chatml`);
- `--chat-template FILE`: a `.jinja` file, or a `tokenizer_config.json` holding a `chat_template`;
- else the tokenizer's own directory (an imported model's `hf/` folder, or any Hugging Face model directory):
  `chat_template.jinja` (what transformers 5 saves), else the `chat_template` of `tokenizer_config.json`.

The special tokens a template may read (`bos_token`, `eos_token`, ...) come from that directory's
`tokenizer_config.json`, as transformers passes its `special_tokens_map`.

The environment is transformers' (`transformers.utils.chat_template_utils._cached_compile_jinja_template`, 5.x): a
sandboxed, immutable Jinja environment with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension,
`raise_exception`, `strftime_now`, a `tojson` filter that does not escape HTML, guarded `dict` and `namespace`, and
`{% generation %}` blocks rendered as their content (TRL's training templates carry them; jaxtrain finds the
assistant's tokens without them, see `jaxtrain.data.chat`). Messages are passed as transformers passes them: keys
whose value is null are dropped, and a message's reasoning is also given as `thinking` and `reasoning_content`.

>>> template = ChatTemplate("chatml", BUILTIN_TEMPLATES["chatml"])
>>> template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
'<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from datetime import datetime
from pathlib import Path

from jaxtrain.errors import UserInputError

# ChatML, as transformers' former default template wrote it (and Qwen's templates do, less their system default).
BUILTIN_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
}
TEMPLATE_FILE, TOKENIZER_CONFIG = "chat_template.jinja", "tokenizer_config.json"
# The named special tokens transformers passes to a template (`SPECIAL_TOKENS_ATTRIBUTES`).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the names a message's reasoning goes by
MIN_JINJA = (3, 1, 6)  # older versions have known sandbox escapes (transformers refuses them too)


class ChatTemplateError(UserInputError):
    """A chat template that is missing, unreadable, or fails on a conversation."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template (`source`), where it came from (`name`), and the special tokens it is given."""

    name: str
    source: str
    special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def digest(self) -> str:
        """SHA-256 of the template text: tokenized chat data records it."""
        return hashlib.sha256(self.source.encode("utf-8")).hexdigest()

    def check(self) -> None:
        """Compile the template: one that does not parse is a `ChatTemplateError` before any conversation is read."""
        _compiled(self.source, self.name)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """`messages` rendered as transformers' `apply_chat_template(messages, tokenize=False, ...)` renders them;
        a template that fails (a Jinja error, its own `raise_exception`) raises a `ChatTemplateError` saying so."""
        compiled = _compiled(self.source, self.name)  # first: it says so if jinja2 is missing
        import jinja2

        try:
            return compiled.render(
                messages=[_as_transformers_passes(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template ({self.name}) failed: {err}.") from None
        except Exception as err:  # noqa: BLE001 - a template is a program: str + None and the like raise anything
            raise ChatTemplateError(f"the chat template ({self.name}) failed: {type(err).__name__}: {err}.") from None


def _as_transformers_passes(message: dict) -> dict:
    """A message as transformers hands it to a template: null values dropped, reasoning under every name read."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if k in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def find_chat_template(tokenizer: str | Path, named: str | None = None) -> ChatTemplate:
    """The chat template for the tokenizer at `tokenizer` (a tokenizer.json or a model directory): the one `named`
    (a built-in name, a .jinja file or a tokenizer_config.json), else the tokenizer directory's own (see the module
    docstring), with that directory's special tokens."""
    directory, config = _tokenizer_config(tokenizer)
    special = special_tokens(tokenizer)
    if named:
        return ChatTemplate(named, _named_template(named), special)
    if (directory / TEMPLATE_FILE).is_file():
        return ChatTemplate(str(directory / TEMPLATE_FILE), _read_text(directory / TEMPLATE_FILE), special)
    if config.get("chat_template"):
        return ChatTemplate(str(directory / TOKENIZER_CONFIG), _config_template(config, directory), special)
    raise ChatTemplateError(
        f"the tokenizer '{tokenizer}' has no chat template: '{directory}' holds no {TEMPLATE_FILE} and no "
        f"{TOKENIZER_CONFIG} with a chat_template. Name one: --chat-template "
        f"{' | '.join(BUILTIN_TEMPLATES)} | FILE.jinja | tokenizer_config.json."
    )


def optional_chat_template(tokenizer: str | Path, named: str | None = None) -> ChatTemplate | None:
    """`find_chat_template`'s, or None where none is named and the tokenizer has none (plain-text prompts need none;
    a conversation without one is then an error naming its line)."""
    try:
        return find_chat_template(tokenizer, named)
    except ChatTemplateError:
        if named:
            raise
        return None


def special_tokens(tokenizer: str | Path) -> dict[str, str]:
    """The special tokens' texts (bos_token, eos_token, ...) the tokenizer's directory names in its
    tokenizer_config.json; empty without one."""
    config = _tokenizer_config(tokenizer)[1]
    return {k: _token_text(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}


def _tokenizer_config(tokenizer: str | Path) -> tuple[Path, dict]:
    tokenizer = Path(tokenizer)
    directory = tokenizer if tokenizer.is_dir() else tokenizer.parent
    return directory, _read_config(directory / TOKENIZER_CONFIG) if (directory / TOKENIZER_CONFIG).is_file() else {}


def _named_template(named: str) -> str:
    if named in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[named]
    path = Path(named)
    if not path.is_file():
        raise ChatTemplateError(
            f"--chat-template {named} is neither a built-in template ({', '.join(BUILTIN_TEMPLATES)}) nor a file: "
            "give a built-in name, a .jinja file or a tokenizer_config.json with a chat_template."
        )
    if path.suffix == ".json":
        config = _read_config(path)
        if not config.get("chat_template"):
            raise ChatTemplateError(f"'{path}' has no chat_template: give a file that has one, or a .jinja file.")
        return _config_template(config, path)
    return _read_text(path)


def _config_template(config: dict, where: Path) -> str:
    """tokenizer_config.json's template: a string, or a list of named ones of which "default" is the template."""
    template = config["chat_template"]
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
        if template is None:
            raise ChatTemplateError(
                f"'{where}' has chat templates named {', '.join(map(str, named))} and none named 'default': save the "
                "one to use as a .jinja file and give it with --chat-template FILE."
            )
    if not isinstance(template, str):
        raise ChatTemplateError(f"'{where}': chat_template is {type(template).__name__}, not a Jinja string.")
    return template


def _token_text(token: str | dict) -> str:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken object with `content`."""
    return token["content"] if isinstance(token, dict) else str(token)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ChatTemplateError(f"chat template '{path}' cannot be read as UTF-8 text ({err}).") from None


def _read_config(path: Path) -> dict:
    try:
        config = json.loads(_read_text(path))
    except ValueError as err:
        raise ChatTemplateError(f"'{path}' is not valid JSON ({err}).") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"'{path}' holds {type(config).__name__}, not a JSON object of tokenizer settings.")
    return config


@functools.cache  # once per template and process: compiling parses the whole template
def _compiled(source: str, name: str):
    """`source` compiled in transformers' environment; a syntax error is a `ChatTemplateError` naming the line."""
    environment = _environment()
    import jinja2

    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(
            f"the chat template ({name}) does not parse: line {err.lineno}: {err.message}."
        ) from None


@functools.cache
def _environment():
    """transformers' chat-template environment (see the module docstring)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatTemplateError("chat templates need jinja2: pip install 'jinja2>=3.1.6'.") from None
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_JINJA:
        raise ChatTemplateError(
            f"chat templates need jinja2 >= 3.1.6 (older ones have sandbox escapes), found {jinja2.__version__}: "
            "pip install -U jinja2."
        )
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_blocks_class(), jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_TemplateDict(),
        namespace=_namespace_class(),
    )
    return env


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' writes plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateDict:
    """`dict(...)` for templates, without the class itself (whose attributes a template could climb through)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _namespace_class():
    """Jinja's `namespace`, refusing names that start with an underscore (a way into CPython's internals)."""
    import jinja2
    import jinja2.utils

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the namespace attribute {name!r}.")

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # Jinja's signature trick, so that namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _generation_blocks_class():
    import jinja2
    import jinja2.ext
    import jinja2.nodes

    class GenerationBlocks(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its content (transformers also records where)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_content"), [], [], body).set_lineno(lineno)

        def _content(self, caller):
            return caller()

    return GenerationBlocks
