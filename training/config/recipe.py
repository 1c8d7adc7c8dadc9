"""Recipe YAML -> the frozen dataclasses of ``training/config/schema.py``, with type checks.

Reads the file (duplicate keys refused), applies ``--set`` overrides, checks every key against the
section's fields and every value against the field's type, then builds the ``Recipe`` (whose
sections validate themselves and each other). Every error is a one-line ``ValueError`` naming
the recipe key, the value and the fix, because the user's next action is to edit that key (or its
``--set`` override) and nothing else.

Example::

    recipe = load_recipe("recipes/tiny_mixtral.yaml", ["train.steps=50", "model.moe.top_k=1"])
    recipe.model.num_params(active=True)
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import yaml

from model.config import CONFIG_CLASSES, FAMILIES, DenseConfig, MoEConfig, TransformerConfig, is_int
from training.config.schema import SECTIONS, Recipe

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RECIPE = REPO_ROOT / "recipes" / "tiny_mixtral.yaml"

__all__ = ["DEFAULT_RECIPE", "REPO_ROOT", "Recipe", "apply_overrides", "load_recipe",
           "recipe_from_dict"]


def load_recipe(path: str | Path | None, overrides: Sequence[str] = ()) -> Recipe:
    """Reads a recipe YAML, applies ``--set`` overrides and validates everything.

    Args:
        path: Recipe file; None means ``recipes/tiny_mixtral.yaml``. A relative path that does not
            exist under the working directory is also looked up under the repo root.
        overrides: ``dotted.key=value`` strings; values are parsed as YAML and type-checked.

    Returns:
        The validated, frozen recipe.

    Raises:
        ValueError: one line naming the key, the value and the fix.
    """
    path = Path(DEFAULT_RECIPE if path is None else path)
    if not path.is_file() and not path.is_absolute() and (REPO_ROOT / path).is_file():
        path = REPO_ROOT / path
    if not path.is_file():
        raise ValueError(f"--recipe: file not found: {path} (pass a YAML from recipes/)")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_StrictLoader)
    except UnicodeDecodeError as exc:
        raise ValueError(f"--recipe: {path} is not UTF-8 text ({exc.reason} at byte {exc.start}): "
                         f"save it as UTF-8") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ValueError(f"--recipe: invalid YAML in {path}{where}: {problem} "
                         f"(fix the syntax there)") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--recipe: {path} must be a YAML mapping of sections (name, model, "
                         f"train, ...), got {_show(raw)}")
    return recipe_from_dict(apply_overrides(raw, overrides))


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def parse_value(text: str) -> Any:
    """A ``--set`` value: YAML, except that numbers YAML 1.1 reads as strings (``1e-3``, ``3E5``)
    are numbers; an unparsable text (an unquoted glob such as ``*.txt``) stays text."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str], what: str = "recipe key",
                    prefix: str = "") -> dict[str, Any]:
    """Returns a deep copy of ``raw`` with each ``<prefix>dotted.key=value`` set (value parsed as
    YAML); ``what`` names the keys in errors."""
    out = copy.deepcopy(dict(raw))
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip()[len(prefix):].split(".")
        if not sep or not all(parts):
            raise ValueError(f"--set {item!r}: expected dotted.key=value, e.g. train.steps=50")
        value = parse_value(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            elif not isinstance(node[part], dict):
                raise ValueError(f"--set {item!r}: {what} {'.'.join(parts[:i + 1])} is a "
                                 f"value, not a section: set it directly")
            node = node[part]
        node[parts[-1]] = value
    return out


def recipe_from_dict(d: Mapping[str, Any]) -> Recipe:
    """Builds and validates a Recipe from plain data (parsed YAML or ``Recipe.to_dict()``)."""
    _check_keys(d, ["name", "model", *SECTIONS], prefix="")
    if d.get("name") is None:
        raise ValueError("recipe key name is missing: add name: <run name> (runs/<name> is the "
                         "default run directory)")
    name = _check_type("name", d["name"], str)
    sections = {s: cls(**_typed_kwargs(cls, d.get(s), s)) for s, cls in SECTIONS.items()}
    return Recipe(name=name, model=_build_model(d.get("model")), **sections)


def _build_model(raw: Any) -> TransformerConfig:
    raw = dict(_mapping(raw, "model"))
    family = raw.pop("family", None)
    if family is None:
        raise ValueError(f"recipe key model.family is missing: set it to one of "
                         f"{', '.join(FAMILIES)}")
    if family not in CONFIG_CLASSES:
        raise ValueError(f"recipe key model.family: expected one of {'|'.join(FAMILIES)}, got "
                         f"{_show(family)}{_did_you_mean(str(family), FAMILIES)}")
    cls = CONFIG_CLASSES[family]
    moe_raw = raw.pop("moe", None)
    kwargs = _typed_kwargs(cls, raw, "model")
    # null (or no) moe section = the family's defaults; a section updates those defaults, so a
    # family switch via --set keeps the recipe's explicit MoE choices and nothing else.
    if moe_raw is not None:
        if cls is DenseConfig:
            raise ValueError("recipe key model.moe is set but model.family is dense: remove the "
                             "moe section (--set model.moe=null) or choose switch or mixtral")
        moe_kwargs = _typed_kwargs(MoEConfig, moe_raw, "model.moe")
        kwargs["moe"] = dataclasses.replace(cls().moe, **moe_kwargs)
    return cls(**kwargs).validate()


def _typed_kwargs(cls: type, raw: Any, prefix: str) -> dict[str, Any]:
    """Checks the keys of ``raw`` against ``cls``'s fields and the values against their types."""
    raw = _mapping(raw, prefix)
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "moe"]
    extra = ["family", "moe"] if prefix == "model" else []
    _check_keys(raw, names + extra, prefix)
    return {k: _check_type(f"{prefix}.{k}", v, hints[k]) for k, v in raw.items() if k in names}


def _mapping(raw: Any, prefix: str) -> Mapping[str, Any]:
    if raw is None:  # an empty section ("eval:") means all defaults
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"recipe key {prefix}: expected a mapping of keys, got {_show(raw)}")
    return raw


def _check_keys(raw: Mapping[str, Any], valid: Sequence[str], prefix: str) -> None:
    dot = f"{prefix}." if prefix else ""
    for key in raw:
        if key not in valid:
            hint = _did_you_mean(str(key), valid, dot) or (
                f" (valid keys{' under ' + prefix if prefix else ''}: {', '.join(valid)})")
            raise ValueError(f"unknown recipe key '{dot}{key}'{hint}")


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Returns ``value`` (ints widened to float, lists to tuples) if it matches ``tp``."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _check_type(key, value, arg)
            except ValueError:
                pass
    elif value is None:
        pass
    elif origin is Literal:
        if value in args and isinstance(value, str):
            return value
        hint = _did_you_mean(value, args) if isinstance(value, str) else ""
        raise ValueError(f"recipe key {key}: expected {_type_name(tp)}, got {_show(value)}{hint}")
    elif origin is tuple:
        if isinstance(value, (list, tuple)) and all(isinstance(v, args[0]) for v in value):
            return tuple(value)
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    elif tp is int:
        if is_int(value):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # PyYAML follows YAML 1.1, which reads 1e-3 (no dot) as a string: accept what float()
        # reads so that recipes may write coefficients the way papers do.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    raise ValueError(f"recipe key {key}: expected {_type_name(tp)}, got {_show(value)}")


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + "|".join(args)
    if origin is tuple:
        return f"list of {args[0].__name__}"
    return tp.__name__


def _show(value: Any) -> str:
    if value is None:
        return "null"
    kind = {dict: "mapping", list: "list", tuple: "list"}.get(type(value), type(value).__name__)
    return f"{kind} {value!r}"


def _did_you_mean(word: str, choices: Sequence[str], prefix: str = "") -> str:
    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{near[0]}'?)" if near else ""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which plain YAML silently resolves to the last."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (keep one)", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)
