"""Tools by name: a registry, a user's file, or VeRL's tool YAML; each checked before Ray starts.

    @register_tool("calculator")
    def calculator(expression: str) -> str:
        "Evaluate an arithmetic expression."

A registered function becomes a tool whose OpenAI schema comes from its signature (str, int,
float and bool parameters; those without a default are required) and its docstring's first
line. A `BaseTool` subclass registers the same way, with its own schema. `tools.names` lists
registered names or `path/to/file.py:Name`; `tools.config_file` is VeRL's tool YAML:

    tools:
      - class_name: my_tools.Gsm8kTool       # a module beside the YAML or on sys.path, or file.py:Class;
                                             # verl.tools.<name>: <name>.py beside the YAML, VeRL's own tools
        config: {type: native}
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: ...}}
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import yaml
from ray import cloudpickle

from rlsys.config.loader import ConfigError, first_line
from rlsys.registry import Registry
from rlsys.tools import verl_compat
from rlsys.tools.base import BaseTool, OpenAIFunctionToolSchema, ToolResponse, schema_dict
from rlsys.user_code import import_user_code, load_entry, split_entry

TOOLS: Registry[Callable | type] = Registry("tool")
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def register_tool(name: str) -> Callable:
    """Register a function (a tool with a schema from its signature) or a `BaseTool` subclass."""
    def add(entry):
        TOOLS.register(name, entry)
        return entry

    return add


@dataclass(frozen=True)
class ToolSpec:
    """How to build one tool in a tool worker, and its schema for the prompt."""

    name: str
    entry: Callable | type
    """A function or a BaseTool subclass."""
    config: dict = field(default_factory=dict)
    schema: dict = field(default_factory=dict)
    """The OpenAI function schema (`{"type": "function", "function": {...}}`)."""

    def build(self) -> BaseTool:
        schema = OpenAIFunctionToolSchema.model_validate(self.schema) if self.schema else None
        if inspect.isclass(self.entry):
            return self.entry(config=self.config, tool_schema=schema)
        return FunctionTool(self.entry, schema)


class FunctionTool(BaseTool):
    """A plain function as a tool: each call is `fn(**arguments)`, run in a thread when it is not
    async; its return value, as text, is the response."""

    def __init__(self, fn: Callable, schema: OpenAIFunctionToolSchema):
        self.fn = fn
        super().__init__({}, schema)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**parameters)
        else:
            result = await asyncio.to_thread(self.fn, **parameters)
        return ToolResponse(text=str(result)), 0.0, {}


def load_tools(names: list[str], config_file: str, key: str = "tools",
               configs: dict[str, dict] | None = None) -> list[ToolSpec]:
    """The tools of `tools.names` and `tools.config_file`, each built once here to check it;
    `configs` holds the config of a tool class named in `names`, by tool name."""
    specs = [_named_spec(name, f"{key}.names[{i}]", configs or {}) for i, name in enumerate(names)]
    if config_file:
        specs.extend(_yaml_specs(config_file, f"{key}.config_file"))
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ConfigError(f"{key}: two tools are named {spec.name!r}")
        seen.add(spec.name)
    return specs


def _named_spec(name: str, key: str, configs: dict[str, dict]) -> ToolSpec:
    if ":" in name:
        entry, tool_name, path = load_entry(name, key)
        if entry is None:
            raise ConfigError(f"{key}: {path} has no {tool_name!r}")
    elif name in TOOLS:
        entry, tool_name = TOOLS[name], name
    else:
        raise ConfigError(f"{key}: unknown tool {name!r}; registered: {', '.join(TOOLS.names())} "
                          "(or give path/to/file.py:Name)")
    schema = _function_schema(tool_name, entry, key) if not inspect.isclass(entry) else {}
    config = dict(configs.get(tool_name) or {}) if inspect.isclass(entry) else {}
    return _checked(ToolSpec(tool_name, entry, config, schema), key)


def _yaml_specs(path: str, key: str) -> list[ToolSpec]:
    specs = []
    for i, entry in enumerate(_yaml_entries(path, key)):
        where = f"{key}: {path} tools[{i}]"
        config = dict(entry.get("config") or {})
        if config.get("type", "native") != "native":
            raise ConfigError(f"{where}.config.type: only native tools run in rlsys (got {config['type']!r})")
        cls = _import_class(entry["class_name"], os.path.dirname(os.path.abspath(path)), where)
        schema = entry.get("tool_schema") or {}
        name = (schema.get("function") or {}).get("name", "") or getattr(cls, "__name__", "")
        specs.append(_checked(ToolSpec(name, cls, config, schema), where))
    return specs


def _yaml_entries(path: str, key: str) -> list[dict]:
    """The `tools:` entries of a tool YAML, each checked for VeRL's shape: a mapping with a
    `class_name` string, and `config` and `tool_schema` mappings where given."""
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: file not found: {path}")
    try:
        document = yaml.safe_load(open(path))
    except yaml.YAMLError as err:
        raise ConfigError(f"{key}: {path} is not valid YAML: {first_line(err)}") from None
    if not isinstance(document, dict) or not isinstance(document.get("tools"), list):
        raise ConfigError(f"{key}: {path} needs a `tools:` list (VeRL's tool YAML)")
    for i, entry in enumerate(document["tools"]):
        where = f"{key}: {path} tools[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: a mapping with class_name, config and tool_schema is needed")
        if not isinstance(entry.get("class_name"), str) or not entry["class_name"]:
            raise ConfigError(f"{where}.class_name: a string (module.Class or file.py:Class) is needed")
        for field_name in ("config", "tool_schema"):
            if entry.get(field_name) is not None and not isinstance(entry[field_name], dict):
                raise ConfigError(f"{where}.{field_name}: a mapping is needed, got {type(entry[field_name]).__name__}")
        function = (entry.get("tool_schema") or {}).get("function")
        if function is not None and not isinstance(function, dict):
            raise ConfigError(f"{where}.tool_schema.function: a mapping is needed")
    return document["tools"]


def _import_class(class_name: str, beside: str, key: str) -> type:
    """`file.py:Class`, or a dotted `module.Class` found beside the YAML file or on sys.path."""
    if ":" in class_name:
        path, attribute = split_entry(class_name)
        module = import_user_code(path if os.path.isabs(path) else os.path.join(beside, path), f"{key}.class_name")
    else:
        module_name, _, attribute = class_name.rpartition(".")
        if module_name.startswith("verl.tools."):
            verl_compat.add_tool_dir(beside)  # VeRL's own tool modules, beside their YAML
        found = _beside(module_name, beside)
        module = import_user_code(found, f"{key}.class_name") if found else _import_module(module_name, key)
    cls = getattr(module, attribute, None)
    if not inspect.isclass(cls):
        raise ConfigError(f"{key}.class_name: no class {attribute!r} in {module.__file__}")
    return cls


def _beside(module_name: str, beside: str) -> str | None:
    """The file (or package directory) of a module at its dotted path under the YAML's directory."""
    relative = os.path.join(beside, *module_name.split("."))
    if os.path.isfile(relative + ".py"):
        return relative + ".py"
    return relative if os.path.isfile(os.path.join(relative, "__init__.py")) else None


def _import_module(module_name: str, key: str) -> ModuleType:
    """A module by its name (a package's module keeps its relative imports). One that is not an
    installed package's travels to the tool workers by value, as a user's file does. An error
    inside the module is reported as it is."""
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # no such module, or the module's own code failed
        missing = getattr(err, "name", None) if isinstance(err, ModuleNotFoundError) else None
        if missing is not None and (module_name == missing or module_name.startswith(missing + ".")):
            raise ConfigError(f"{key}.class_name: cannot find module {module_name!r} (beside the YAML or on "
                              "sys.path)") from None
        raise ConfigError(f"{key}.class_name: importing {module_name} failed: {type(err).__name__}: "
                          f"{first_line(err)}") from None
    if not _importable_everywhere(module):
        cloudpickle.register_pickle_by_value(module)
    return module


def _importable_everywhere(module: ModuleType) -> bool:
    """Whether the tool workers import `module` by name: rlsys's own, or an installed package's."""
    path = getattr(module, "__file__", None)
    if not path or module.__name__.split(".")[0] == "rlsys":
        return True
    installed = {sysconfig.get_paths()[kind] for kind in ("purelib", "platlib")}
    return any(os.path.abspath(path).startswith(os.path.abspath(root) + os.sep) for root in installed)


def _checked(spec: ToolSpec, key: str) -> ToolSpec:
    """Build the tool once: a tool that cannot be built is a config error; its schema is filled in."""
    try:
        tool = spec.build()
    except Exception as err:  # the user's constructor
        raise ConfigError(f"{key}: tool {spec.name!r} cannot be built: {type(err).__name__}: {first_line(err)}") \
            from None
    return ToolSpec(tool.name, spec.entry, spec.config, schema_dict(tool))


def _function_schema(name: str, fn: Callable, key: str) -> dict:
    properties, required = {}, []
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(parameter.annotation if not isinstance(parameter.annotation, str)
                               else {"str": str, "int": int, "float": float, "bool": bool}.get(parameter.annotation))
        if kind is None:
            raise ConfigError(f"{key}: parameter {parameter.name!r} of tool {name!r} needs a str, int, float or bool "
                              "annotation")
        properties[parameter.name] = {"type": kind}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    description = (inspect.getdoc(fn) or name).strip().splitlines()[0]
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}
