"""OpenEnv environments (PyPI `openenv-core`, its `openenv.core` API) run unmodified as
megagrpo multi-turn environments, token in / token out.

    agent.environment: openenv:my_envs:GuessEnv      # an openenv.core Environment subclass,
                                                     # one instance per trajectory, in the rank
    agent.environment: openenv:http://host:8000      # its server (openenv's create_app): one
                                                     # WebSocket session per trajectory through
                                                     # openenv's own client (GenericEnvClient)
    agent.kwargs: {action_field: message, observation_field: feedback, role: user,
                   env_kwargs: {}}                   # all optional, see below

Per trajectory: `reset(**record)` (the prompt's data record; OpenEnv's server passes the keys
the environment's `reset` accepts, and so does the in-process path); the prompt the model sees
is the data record's, rendered by the run's chat template (data.template=chat), and the reset's
observation is not shown. Each assistant turn: its text (the sampled ids decoded) becomes the
action `{action_field: text}`, validated by the environment's Action class; the step's reward
(None = 0) is the turn's reward and its `done` ends the trajectory; otherwise the observation's
`observation_field` string is a message of `role` rendered by the chat template as it continues
after the assistant turn (the template's own closing of that turn minus what the model sampled
itself, the message, the next generation prompt), encoded once: `Observation.token_ids`. The
model's ids are never re-encoded. Special-token strings in the hub's text are defused and the
encoded message must hold exactly the control tokens the template writes around an empty one.

action_field / observation_field default to the one string field of the Action (besides
`metadata`) / Observation (besides done, reward, metadata); their JSON schemas come from the
classes (in process) or the server's /schema (checked before compute, so a server that does
not answer is refused then). A raise, a server error, a timeout (agent.env_timeout_s) or a
step the Action class refuses goes through the runner's containment: retried up to
agent.env_retries, then the trajectory fails (truncation 'env_error', agent.on_env_error).
"""
from __future__ import annotations

import functools
import inspect
import json
import typing
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from megagrpo.agent.env import Environment, Observation, Turn
from megagrpo.agent.tool_env import (
    _overlap,
    defuse,
    sampled_tail,
    templated_tokenizer,
    tokenizer_name,
)
from megagrpo.config.agent import OPENENV, AgentConfig
from megagrpo.runtime.names import import_object

FIELD = "agent.environment"
KWARGS = ("action_field", "observation_field", "role", "env_kwargs")
_QUESTION = "\ue000megagrpo-question\ue001"
_ASSISTANT = "\ue000megagrpo-assistant\ue001"
_MESSAGE = "\ue000megagrpo-message\ue001"
SCHEMA_TIMEOUT_S = 10.0
"""How long the check before compute waits for the server's /schema."""


@dataclass(frozen=True)
class MessageTemplate:
    """The run's chat template, checked to render a message of `role` after an assistant turn."""

    tokenizer: object
    """The Hugging Face tokenizer."""
    role: str
    lead: int
    """Characters between the assistant's content and the message's (the turn's closing, the
    message's opening): at most this much of the continuation can be text the model sampled."""

    def continuation(self, content: str, tail: str) -> str:
        """The template's text after an assistant turn answered by a message `content` of
        `role`, with the next generation prompt, minus the part of the turn's closing that
        `tail` (the turn's last text, special tokens included) already ends with."""
        messages = [{"role": "user", "content": _QUESTION},
                    {"role": "assistant", "content": _ASSISTANT},
                    {"role": self.role, "content": content}]
        full = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        after = full[full.index(_ASSISTANT) + len(_ASSISTANT):]
        return after[_overlap(tail, after, self.lead):]

    def encode(self, content: str, tail: str) -> tuple[str, list[int]]:
        """(text, ids) of the continuation with the hub's `content` defused; ValueError when
        its ids hold control tokens the template does not write around an empty message."""
        text = self.continuation(defuse(self.tokenizer, content), tail)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        want = self.tokenizer.encode(self.continuation("", tail), add_special_tokens=False)
        if _controls(self.tokenizer, ids) != _controls(self.tokenizer, want):
            raise ValueError("the environment's message holds control tokens of the chat "
                             "template (not shown to the model)")
        return text, ids


def _controls(tokenizer: object, ids: list[int]) -> list[int]:
    """The special and added-vocabulary ids in `ids`, in order; the unknown token is not one (a
    character outside a small vocabulary, e.g. the zero-width space `defuse` inserts, encodes
    as it, and it opens or closes no turn)."""
    special = set(getattr(tokenizer, "all_special_ids", None) or [])
    special.update(getattr(tokenizer, "get_added_vocab", lambda: {})().values())
    special.discard(getattr(tokenizer, "unk_token_id", None))
    return [i for i in ids if i in special]


def check_message_template(tokenizer: object, role: str) -> MessageTemplate:
    """The run's chat template rendering a `role` message after an assistant turn; ValueError
    naming agent.environment (no template) or agent.kwargs.role (the template refuses it)."""
    hf = templated_tokenizer(tokenizer, f"{FIELD}=openenv:... renders the environment's "
                             "messages through the chat template")
    name = tokenizer_name(hf)
    messages = [{"role": "user", "content": _QUESTION},
                {"role": "assistant", "content": _ASSISTANT},
                {"role": role, "content": _MESSAGE}]
    try:
        full = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja's TemplateError, a raise_exception(...)
        raise ValueError(f"agent.kwargs.role={role!r}: the chat template of tokenizer {name!r} "
                         f"fails on a {role!r} message after an assistant turn "
                         f"({type(e).__name__}: {e}); use a role it renders, e.g. 'user'") from None
    start = full.find(_ASSISTANT) + len(_ASSISTANT)
    if start < len(_ASSISTANT) or full.find(_MESSAGE, start) < 0:
        raise ValueError(f"agent.kwargs.role={role!r}: the chat template of tokenizer {name!r} "
                         "does not render that message after an assistant turn")
    return MessageTemplate(hf, role, full.index(_MESSAGE, start) - start)


class LocalSession:
    """One in-process instance of an OpenEnv environment class."""

    def __init__(self, cls: type, env_kwargs: dict, action_cls: type) -> None:
        self.env, self.action_cls = cls(**env_kwargs), action_cls

    def reset(self, record: dict) -> dict:
        """The reset's result as OpenEnv's server serializes it; `record`'s keys the reset
        accepts are passed (all of them when it takes **kwargs), as the server does."""
        params = inspect.signature(self.env.reset).parameters
        takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
        return _serialized(self.env.reset(**{k: v for k, v in record.items()
                                              if takes_all or k in params}))

    def step(self, action: dict) -> dict:
        return _serialized(self.env.step(self.action_cls.model_validate(action)))

    def close(self) -> None:
        self.env.close()


def _serialized(observation: object) -> dict:
    from openenv.core.env_server.serialization import serialize_observation

    return serialize_observation(observation)


class RemoteSession:
    """One WebSocket session of an OpenEnv server, through openenv's own client."""

    def __init__(self, url: str, timeout_s: float) -> None:
        from openenv.core.generic_client import GenericEnvClient

        limits = {"connect_timeout_s": timeout_s, "message_timeout_s": timeout_s} \
            if timeout_s > 0 else {}
        self.client = GenericEnvClient(base_url=url, **limits).sync()
        self.client.connect()

    def reset(self, record: dict) -> dict:
        return _result(self.client.reset(**record))

    def step(self, action: dict) -> dict:
        return _result(self.client.step(action))

    def close(self) -> None:
        self.client.close()


def _result(result: object) -> dict:
    return {"observation": result.observation, "reward": result.reward, "done": result.done}


class OpenEnvEnvironment(Environment):
    """A megagrpo environment over one OpenEnv session (module docstring)."""

    def __init__(self, record: dict, tokenizer: object = None, *, connect: typing.Callable,
                 template: MessageTemplate, action_field: str, observation_field: str) -> None:
        super().__init__(record, tokenizer)
        self.template, self.action_field = template, action_field
        self.observation_field = observation_field
        self.session = connect()
        try:
            if self.session.reset(dict(record))["done"]:
                raise ValueError("the environment's reset says done: no turn to take")
        except BaseException:
            self.session.close()
            raise

    def step(self, turn: Turn) -> Observation:
        out = self.session.step({self.action_field: turn.text})
        reward = 0.0 if out["reward"] is None else float(out["reward"])
        if out["done"]:
            return Observation(done=True, reward=reward)
        content = out["observation"].get(self.observation_field)
        if not isinstance(content, str):
            raise TypeError(f"observation field {self.observation_field!r} is "
                            f"{type(content).__name__}, not a string")
        text, ids = self.template.encode(content, sampled_tail(self.template.tokenizer, turn))
        return Observation(text=text, token_ids=tuple(ids), reward=reward)

    def close(self) -> None:
        self.session.close()


def load_openenv(cfg: AgentConfig, tokenizer: object) -> tuple[type, dict]:
    """(OpenEnvEnvironment, its constructor's kwargs) for agent.environment='openenv:...',
    checked before compute: openenv imports, the class (or the server's /schema) gives the
    action and observation fields, the chat template renders the role. ValueError naming the
    field otherwise."""
    unknown = sorted(set(cfg.kwargs) - set(KWARGS))
    if unknown:
        raise ValueError(f"agent.kwargs {unknown}: an OpenEnv environment accepts {list(KWARGS)}")
    role = cfg.kwargs.get("role", "user")
    if not isinstance(role, str) or not role:
        raise ValueError(f"agent.kwargs.role={role!r} must be a chat role, e.g. 'user'")
    template = check_message_template(tokenizer, role)
    _need_openenv(cfg.environment)
    target = cfg.environment[len(OPENENV):]
    if "://" in target:
        if "env_kwargs" in cfg.kwargs:
            raise ValueError("agent.kwargs.env_kwargs are constructor arguments of an in-process "
                             f"class; {FIELD}={cfg.environment!r} is a server (it builds its own)")
        schemas = server_schemas(target, cfg.environment)
        connect = functools.partial(RemoteSession, target, cfg.env_timeout_s)
    else:
        cls, action_cls, obs_cls = environment_classes(cfg.environment)
        env_kwargs = cfg.kwargs.get("env_kwargs", {})
        if not isinstance(env_kwargs, dict):
            raise ValueError(f"agent.kwargs.env_kwargs={env_kwargs!r} must be a mapping")
        try:
            inspect.signature(cls).bind(**env_kwargs)
        except TypeError as e:
            raise ValueError(f"agent.kwargs.env_kwargs {env_kwargs} do not fit "
                             f"{cls.__name__}(**env_kwargs): {e}") from None
        schemas = {"action": action_cls.model_json_schema(),
                   "observation": obs_cls.model_json_schema()}
        connect = functools.partial(LocalSession, cls, env_kwargs, action_cls)
    action = _string_field(schemas["action"], "action_field", cfg.kwargs.get("action_field"),
                           {"metadata"}, only_required=True)
    observation = _string_field(schemas["observation"], "observation_field",
                                cfg.kwargs.get("observation_field"),
                                {"done", "reward", "metadata"}, only_required=False)
    return OpenEnvEnvironment, {"connect": connect, "template": template,
                                "action_field": action, "observation_field": observation}


def _need_openenv(spec: str) -> None:
    try:
        import openenv.core  # noqa: F401 - the package's import is the check
    except ImportError as e:
        raise ValueError(f"{FIELD}={spec!r} needs the openenv-core package ({e}); "
                         "scripts/setup_venv.sh installs it") from None


def environment_classes(spec: str) -> tuple[type, type, type]:
    """(class, Action class, Observation class) of 'openenv:module:Class': an openenv.core
    Environment subclass whose step's annotations (or generic parameters) give the types."""
    from openenv.core.env_server.interfaces import Environment as HubEnvironment
    from openenv.core.env_server.types import Action as HubAction
    from openenv.core.env_server.types import Observation as HubObservation

    cls = import_object(spec[len(OPENENV):], f"{FIELD}={spec!r}")
    if not (isinstance(cls, type) and issubclass(cls, HubEnvironment)):
        raise ValueError(f"{FIELD}={spec!r} is not a subclass of "
                         "openenv.core.env_server.interfaces.Environment")
    try:
        hints = typing.get_type_hints(cls.step)
    except Exception:  # noqa: BLE001 - unresolvable annotations: the generic parameters then
        hints = {}
    generic = next((typing.get_args(b) for k in cls.__mro__
                    for b in vars(k).get("__orig_bases__", ())
                    if typing.get_origin(b) is HubEnvironment and typing.get_args(b)), ())
    # an annotation that is a class wins; an inherited TypeVar (ActT) does not
    action = hints.get("action") if isinstance(hints.get("action"), type) else \
        (generic[0] if generic else None)
    obs = hints.get("return") if isinstance(hints.get("return"), type) else \
        (generic[1] if len(generic) > 1 else None)
    for what, got, base in (("action", action, HubAction), ("observation", obs, HubObservation)):
        if not (isinstance(got, type) and issubclass(got, base)):
            raise ValueError(f"{FIELD}={spec!r}: its {what} type is unknown: annotate "
                             f"step(self, action: MyAction) -> MyObservation or subclass "
                             f"Environment[MyAction, MyObservation, State]")
    return cls, action, obs


def server_schemas(url: str, spec: str) -> dict:
    """The OpenEnv server's GET /schema ({action, observation, state} JSON schemas); ValueError
    naming agent.environment when it does not answer with one."""
    parts = urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)
    where = urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/schema", "", ""))
    try:
        with urllib.request.urlopen(where, timeout=SCHEMA_TIMEOUT_S) as r:  # noqa: S310 - http(s)
            schemas = json.loads(r.read())
    except Exception as e:  # noqa: BLE001 - refused, timed out, not JSON: one message
        raise ValueError(f"{FIELD}={spec!r}: no OpenEnv server answers GET {where} "
                         f"({type(e).__name__}: {e}); start the server first") from None
    if not (isinstance(schemas, dict) and all(isinstance(schemas.get(k), dict)
                                              for k in ("action", "observation"))):
        raise ValueError(f"{FIELD}={spec!r}: GET {where} is not an OpenEnv /schema answer")
    return schemas


def _string_field(schema: dict, name: str, given: object, skip: set[str], *,
                  only_required: bool) -> str:
    """The string field of a JSON schema the turn's text goes into (action) or the message
    comes from (observation): agent.kwargs.<name>, or the only one. With `only_required`, no
    other field may be required (the adapter fills only this one)."""
    props = schema.get("properties", {})
    strings = [k for k, v in props.items() if k not in skip and _is_string(v)]
    field = given if given is not None else (strings[0] if len(strings) == 1 else None)
    if field is None:
        raise ValueError(f"agent.kwargs.{name}: name the string field to use; the "
                         f"environment's string fields are {strings}")
    if field not in strings:
        raise ValueError(f"agent.kwargs.{name}={field!r} is not a string field of the "
                         f"environment's {schema.get('title', 'schema')} (its string fields: "
                         f"{strings})")
    others = sorted(set(schema.get("required", [])) - {field})
    if only_required and others:
        raise ValueError(f"agent.kwargs.{name}={field!r}: the action also requires {others}, "
                         "which the model's text cannot fill")
    return field


def _is_string(prop: dict) -> bool:
    return prop.get("type") == "string" or any(a.get("type") == "string"
                                               for a in prop.get("anyOf", []))
