"""``dataflex plugins`` and ``dataflex info``: what is installed, shown to people.

The plugin table (or stable JSON) with each plugin's status, components, warnings and errors; with
``--check``, every component imported in a child process (:mod:`dataflex_bus.plugin_check`); and one
component's card: parameters, timing, the events it can act at and an example block that validates.
Listing imports no component module (and so no torch).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .mechanisms import component_kinds, for_kind, mechanisms


def plugins_report() -> list[dict[str, Any]]:
    """The ``dataflex plugins --json`` document: sorted by name, then distribution; a name two active
    plugins provide in one slot is a warning of each (:func:`flag_collisions`)."""
    from .discovery import get_plugins

    report = _sorted_report([r.as_json() for r in get_plugins().records])
    flag_collisions(report)
    return report


def checked_report(timeout: float = 300.0) -> list[dict[str, Any]]:
    """``plugins_report`` with every component imported in a child process (``plugins --check``, doctor)."""
    from .plugin_check import check_plugins

    report = _sorted_report(check_plugins(timeout=timeout))
    flag_collisions(report)
    return report


def _provider(record: dict[str, Any], name: str) -> str:
    from .registry import normalize_name

    return f"{normalize_name(record['distribution'] or record['name'])}:{name} (plugin {record['name']!r})"


def flag_collisions(report: list[dict[str, Any]]) -> list[str]:
    """Add a warning to each active plugin that shares a component name with another in one config slot
    (a config naming it bare is refused); returns one problem line per shared name."""
    from .registry import slot_of

    providers: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in report:
        if record["status"] == "active":
            for c in record["components"]:
                providers.setdefault((slot_of(c["kind"]), c["name"]), []).append(record)
    problems = []
    for (slot, name), records in sorted(providers.items()):
        if len(records) < 2:
            continue
        names = [_provider(r, name) for r in records]
        problems.append(f"{slot} name {name!r} is provided by more than one plugin: {', '.join(names)}; a config "
                        f"naming it bare is refused: use a qualified name")
        for record, own in zip(records, names):
            others = ", ".join(n for n in names if n != own)
            warning = (f"{slot} name {name!r} is also provided by {others}: configs must name it "
                       f"{own.split(' ')[0]!r}")
            if warning not in record["warnings"]:
                record["warnings"].append(warning)
    return problems


def _sorted_report(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(records, key=lambda r: (r["name"], r["distribution"] or ""))


def _table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def _plugin_rows(record: dict[str, Any]) -> list[list[str]]:
    """One table row per component (or for the error), then one per warning; plugin columns only once."""
    details: list[str] = []
    if record["status"] == "active":
        for c in record["components"]:
            line = f"{c['name']} ({c['kind']})" + (f"  {c['summary']}" if c.get("summary") else "")
            check = c.get("check")
            if check not in (None, "ok"):
                line += f"  CHECK FAILED: {check}"
            details.append(line)
    elif record["status"] == "disabled":
        details.append(f"by {record['disabled_by']}" if record.get("disabled_by") else "")
    else:
        details.append(record["error"] or "")
    details += [f"warning: {w}" for w in record.get("warnings") or []]
    head = [record["name"], record["distribution"] or "-", record["version"] or "-", record["status"]]
    rows = [[*head, details[0] if details else ""]]
    rows += [["", "", "", "", d] for d in details[1:]]
    return rows


def check_problems(report: list[dict[str, Any]]) -> list[str]:
    """What ``plugins --check`` (and doctor) fail on: failed plugins, components that do not import or
    declare invalid attributes, and names two plugins provide in one slot."""
    problems = []
    for r in report:
        label = f"plugin {r['name']!r} ({r['distribution'] or '?'}=={r['version'] or '?'})"
        if r["status"] == "failed":
            problems.append(f"{label}: {r['error']}")
        for c in r["components"]:
            if c.get("check") not in (None, "ok"):
                problems.append(f"{label}: {c['kind']} {c['name']!r} -> {c['target']!r}: {c['check']}")
    return problems + flag_collisions(report)


def cmd_plugins(args: argparse.Namespace) -> int:
    report = checked_report(args.timeout) if args.check else plugins_report()
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        rows = [row for r in report for row in _plugin_rows(r)]
        print(_table(rows, ["PLUGIN", "DISTRIBUTION", "VERSION", "STATUS", "COMPONENTS / ERROR"])
              if rows else "no dataflex plugins installed")
    if not args.check:
        return 0
    problems = check_problems(report)
    if not args.json:
        components = sum(len(r["components"]) for r in report)
        if problems:
            print(f"\ncheck failed: {len(problems)} problem(s)")
            print("\n".join(f"  - {p}" for p in problems))
        else:
            print(f"\ncheck ok: {len(report)} plugin(s), {components} component(s) import and declare valid "
                  "attributes")
    return 1 if problems else 0


# ---------------------------------------------------------------------------- info
def cmd_info(args: argparse.Namespace) -> int:
    from .discovery import get_plugins
    from .errors import UnknownComponentError
    from .registry import article, slot_of
    from .schema import did_you_mean

    registry = get_plugins().registry()
    kind = args.kind
    slots = ["scorer", "actuator", "predictor"] if kind is None else [slot_of(kind)]
    specs = [s for s in registry.find(args.name, slots) if kind in (None, "actuator", s.kind)]
    if not specs and kind is None and (entry := mechanism_info(args.name, registry)) is not None:
        print(json.dumps([entry], indent=2, sort_keys=True) if args.json else _mechanism_text(entry))
        return 0
    if not specs:
        bare = args.name.rpartition(":")[2]
        kinds = [kind] if kind in component_kinds() else None
        known = sorted({n for slot in slots for n in registry.names(slot, kinds)})
        hint = did_you_mean(bare, known, n=3)
        hint = f"; {hint}" if hint else ""
        what = kind or "component"
        other = ""
        found = sorted({s.kind for s in registry.find(args.name)}) if kind is not None else []
        if found:
            other = f" (there is {article(found[0])} {' and '.join(found)} of that name: drop --kind)"
        disabled = next((h for slot in slots if (h := registry.unknown_hint(slot, bare))), "")
        raise UnknownComponentError(
            f"unknown {what} {bare!r}{hint}{other} (installed: {', '.join(known) or 'none'}){disabled}")
    entries = [component_info(spec, registry) for spec in specs]
    if args.json:
        print(json.dumps(entries, indent=2, sort_keys=True, default=str))
        return 0
    if len(entries) > 1:
        names = ", ".join(f"{e['kind']} {e['qualified_name']}" for e in entries)
        print(f"{args.name!r} names {len(entries)} components: {names}; pass --kind (or distribution:name) "
              "to show one\n")
    print("\n\n".join(_info_text(e) for e in entries))
    return 0


def mechanism_info(name: str, registry: Any) -> dict[str, Any] | None:
    """What ``dataflex info`` shows for a mechanism's name (``allocate``) or its actuator kind (``allocator``):
    what it does and the installed actuators that implement it; ``None`` for any other name. Such a name is
    no component, yet it is what a reader of a block (``mechanism: allocate``) looks up first."""
    found = next((m for m in mechanisms() if name in (m.name, m.kind)), None)
    if found is None:
        return None
    return {"name": found.name, "kind": "mechanism", "actuator_kind": found.kind, "summary": found.summary,
            "actuators": registry.names("actuator", [found.kind])}


def _mechanism_text(entry: dict[str, Any]) -> str:
    actuators = ", ".join(entry["actuators"]) or "none installed"
    return (f"{entry['name']!r} is a mechanism, not a component: {entry['summary']}.\n"
            f"A method under it is a scorer times an actuator of kind {entry['actuator_kind']!r} "
            f"(`mechanism: {entry['name']}` in a block).\n"
            f"{entry['actuator_kind']}s installed: {actuators}\n"
            f"`dataflex info NAME` shows one of them (and the scorers it is meant for).")


def component_info(spec: Any, registry: Any) -> dict[str, Any]:
    """Everything ``dataflex info`` shows about one registered component (imports its class)."""
    import inspect

    from .registry import slot_of

    cls = spec.load()
    doc = inspect.cleandoc(cls.__doc__ or "")
    params = []
    for name, p in cls.params.items():
        types = p.types
        params.append({
            "name": name, "type": " or ".join("None" if t is type(None) else t.__name__ for t in types),
            "required": p.required, "default": None if p.required else _plain(p.default),
            "allowed": p.describe(), "low": p.low, "high": p.high,
            "choices": None if p.choices is None else list(p.choices), "doc": p.doc,
        })
    info: dict[str, Any] = {
        "name": spec.name, "kind": spec.kind, "slot": slot_of(spec.kind), "qualified_name": spec.qualified_name,
        "plugin": spec.plugin, "provider": spec.pin, "target": spec.target_text,
        "summary": spec.summary or (doc.splitlines()[0] if doc else ""), "doc": doc,
        "parameters": params, "requires": list(cls.requires), "needs_groups": bool(cls.needs_groups),
    }
    if spec.kind == "predictor":
        return _predictor_info(info, spec, cls, registry)
    if spec.kind == "scorer":
        info.update(timing=cls.timing, granularity=cls.granularity)
    else:
        mechanism = for_kind(spec.kind).name
        info.update(mechanism=mechanism, min_timing=cls.min_timing, accepts=list(cls.accepts))
    info["events"] = _events(spec.kind, cls)
    block, valid = _example_block(spec, cls, registry)
    info["example"] = _yaml_block(block, cls, slot_of(spec.kind))
    info["example_validated"] = valid
    return info


def _predictor_info(info: dict[str, Any], spec: Any, cls: Any, registry: Any) -> dict[str, Any]:
    """A predictor's entry: its columns, its two events and a block that reads it (validated)."""
    import yaml

    from .validation import validate

    info.update(columns=list(cls.columns), events={"on_prompts": "predicts p for the candidates",
                                                   "on_rollout": "observes the rolled-out groups"})
    block = {"predictor": {"name": spec.name}, "mechanism": "select", "scorer": {"name": "predicted"},
             "actuator": {"name": "top_b", "params": {"pool": 4}}}
    try:
        validate(block, registry)
        info["example_validated"] = True
    except Exception:  # a predictor with required parameters: the example is a template
        info["example_validated"] = False
    info["example"] = yaml.safe_dump({"dataflex": block}, sort_keys=False).rstrip()
    return info


def _plain(value: Any) -> Any:
    """A parameter default as JSON/YAML can write it."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _events(kind: str, cls: Any) -> dict[str, str]:
    """The bus events the component can act at, each with the condition (empty when none)."""
    from .components import TIMINGS
    from .hookspecs import EVENTS

    if kind == "scorer":
        if cls.timing == "pre_rollout":
            return {"on_prompts": "with a selector, before generation"}
        first = EVENTS.index(TIMINGS[cls.timing])
        out = {e: "" for e in EVENTS[first:]}
        if "on_rollout" in out:
            out["on_rollout"] = "with a selector that keeps whole groups for these scores"
        if "on_step_end" in out:
            out["on_step_end"] = "mix only"
        return out
    return for_kind(kind).events(cls)


def _example_params(cls: Any) -> dict[str, Any]:
    """Every parameter at its default; a required one gets its declared example, else a value its declaration
    allows."""
    from .schema import REQUIRED

    out = {}
    for name, p in cls.params.items():
        if not p.required:
            out[name] = _plain(p.default)
            continue
        if p.example is not REQUIRED:
            out[name] = _plain(p.example)
            continue
        types = p.types
        if p.choices:
            value: Any = p.choices[0]
        elif bool in types:
            value = False
        elif float in types or int in types:
            lo = p.low if p.low is not None else (p.high - 1 if p.high is not None else 0)
            hi = p.high if p.high is not None else lo + 1
            value = (lo + hi) / 2 if float in types else int(lo) + (1 if p.low_open or p.low is None else 0)
        elif dict in types:
            value = {}
        elif list in types or tuple in types:
            value = []
        else:
            value = "value"
        out[name] = _plain(value)
    return out


def _example_block(spec: Any, cls: Any, registry: Any) -> tuple[dict[str, Any], bool]:
    """A ``dataflex`` block using the component with a fitting partner that passes validation."""
    from .errors import DataflexError
    from .registry import slot_of
    from .validation import validate

    def ref(s: Any, c: Any) -> dict[str, Any]:
        ambiguous = len(registry.find(s.name, [slot_of(s.kind)])) > 1
        return {"name": s.qualified_name if ambiguous else s.name, "params": _example_params(c)}

    names = [m.name for m in mechanisms()]
    if spec.kind == "scorer":
        options = [(m.name, a) for m in mechanisms() for a in registry.specs if a.kind == m.kind]
    else:
        options = [(for_kind(spec.kind).name, s) for s in registry.specs if s.kind == "scorer"]
    loaded = []
    for mechanism, partner in options:
        try:
            loaded.append((mechanism, partner, partner.load()))
        except DataflexError:
            continue

    def preference(option: tuple[str, Any, Any]) -> tuple[int, int, bool, int, str]:
        # The pairing an actuator is defined on (its `intended_scorers`, its paper's) first, one that names none
        # next, one defined on another scorer's statistic last; then the mechanism, the pack's own partners,
        # the pairing the actuator lists first in `accepts`.
        mechanism, partner, p_cls = option
        (scorer, scorer_cls), actuator_cls = ((spec, cls), p_cls) if spec.kind == "scorer" else ((partner, p_cls), cls)
        intended = list(getattr(actuator_cls, "intended_scorers", ()))
        meant = 0 if scorer.name in intended else 2 if intended else 1
        accepts = list(actuator_cls.accepts)
        fit = accepts.index(scorer_cls.granularity) if scorer_cls.granularity in accepts else len(accepts)
        return meant, names.index(mechanism), partner.provider != spec.provider, fit, partner.name

    predictors = registry.names("predictor")

    def make(mechanism: str, other: dict[str, Any], other_cls: Any) -> dict[str, Any]:
        pair = {"scorer": own, "actuator": other} if spec.kind == "scorer" else {"scorer": other, "actuator": own}
        reads = getattr(cls, "uses_predictor", False) or getattr(other_cls, "uses_predictor", False)
        if reads and predictors:  # a reader of the block's prediction needs a predictor named
            return {"predictor": {"name": "cures" if "cures" in predictors else predictors[0]},
                    "mechanism": mechanism, **pair}
        return {"mechanism": mechanism, **pair}

    own = ref(spec, cls)
    ranked = sorted(loaded, key=preference)
    warned = None  # the first block that validates with warnings: shown only when none validates without
    for mechanism, partner, p_cls in ranked:
        block = make(mechanism, ref(partner, p_cls), p_cls)
        try:
            checked = validate(block, registry)
        except DataflexError:
            continue
        if not checked.warnings:
            return block, True
        warned = warned or block
    if warned is not None:
        return warned, True
    if ranked:  # a partner exists, but the placeholder values of required parameters do not validate
        mechanism, partner, p_cls = ranked[0]
        return make(mechanism, ref(partner, p_cls), p_cls), False
    mechanism = names[0] if spec.kind == "scorer" else for_kind(spec.kind).name
    return make(mechanism, {"name": "<none installed fits>", "params": {}}, None), False


def _yaml_block(block: dict[str, Any], cls: Any, slot: str) -> str:
    """The block as YAML; the component's own required parameters are marked (JSON scalars are YAML)."""
    lines = ["dataflex:"]
    if "predictor" in block:
        lines.append(f"  predictor: {{name: {block['predictor']['name']}}}")
    lines.append(f"  mechanism: {block['mechanism']}")
    for name in ("scorer", "actuator"):
        ref = block[name]
        lines.append(f"  {name}:")
        lines.append(f"    name: {json.dumps(ref['name']) if ref['name'].startswith('<') else ref['name']}")
        if not ref["params"]:
            continue
        lines.append("    params:")
        for key, value in ref["params"].items():
            note = ""
            if name == slot and cls.params[key].required:
                note = f"  # required: {cls.params[key].describe()}"
            lines.append(f"      {key}: {_yaml_value(value)}{note}")
    return "\n".join(lines)


def _yaml_value(value: Any) -> str:
    """A parameter value as YAML flow text that PyYAML reads back as the same value: JSON, except floats
    (YAML 1.1 reads ``1e-06`` as a string: the mantissa needs a dot) and the infinities."""
    if isinstance(value, float):
        if value != value:
            return ".nan"
        if value in (float("inf"), float("-inf")):
            return ".inf" if value > 0 else "-.inf"
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    return json.dumps(value)


def _info_text(e: dict[str, Any]) -> str:
    lines = [f"{e['name']} ({e['kind']}) from {e['provider']}, plugin {e['plugin']!r}"]
    if e["summary"]:
        lines.append(f"  {e['summary']}")
    lines.append(f"  target:       {e['target']}")
    lines.append(f"  qualified:    {e['qualified_name']}  (the config name when another pack has the same one)")
    if e["kind"] == "predictor":
        lines.append(f"  columns:      p{''.join(', ' + c for c in e['columns'])} (predicted_<column> in the batch)")
    elif e["kind"] == "scorer":
        lines.append(f"  timing:       {e['timing']}")
        lines.append(f"  granularity:  {e['granularity']}")
    else:
        lines.append(f"  mechanism:    {e['mechanism']}")
        lines.append(f"  min_timing:   {e['min_timing']}")
        lines.append(f"  accepts:      {', '.join(e['accepts'])}")
    lines.append(f"  requires:     {', '.join(e['requires']) or '-'}")
    lines.append(f"  needs_groups: {'yes' if e['needs_groups'] else 'no'}")
    events = ", ".join(f"{ev} ({cond})" if cond else ev for ev, cond in e["events"].items())
    lines.append(f"  events:       {events}")
    if e["parameters"]:
        lines.append("  parameters:")
        for p in e["parameters"]:
            default = "required" if p["required"] else f"default {p['default']!r}"
            lines.append(f"    {p['name']}: {p['allowed']}, {default}" + (f"  ({p['doc']})" if p["doc"] else ""))
    else:
        lines.append("  parameters:   none")
    note = "" if e["example_validated"] else "  # not checked valid: set the required values (and any <...> name)"
    lines.append(f"  example:{note}")
    lines += [f"    {line}" for line in e["example"].splitlines()]
    body = e["doc"].strip()
    if body:
        lines.append("")
        lines += [f"  {line}".rstrip() for line in body.splitlines()]
    return "\n".join(lines)


