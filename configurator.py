"""nanoGPT's configurator, made strict, for every script: in `python train.py config/x.py --batch_size=32`
the arguments without '--' are config files executed in order, then '--key=value' overrides (a bare --key sets a
boolean). Every key has a default; a value keeps its default's type (an int is a valid float) and may follow a rule."""

import ast
import difflib
import inspect
import math
import sys
import traceback


class ConfigError(ValueError):
    pass


def _unknown_key(key, defaults):
    close = difflib.get_close_matches(key, defaults)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; see the defaults at the top of the script"
    return ConfigError(f"unknown config key {key!r}{hint}")


def coerce(key, value, default):
    """`value` as the type of `default` (bool, int, float or str), or a ConfigError."""
    want = type(default)
    if isinstance(value, str) and want is not str:
        text = value.strip()
        if want is bool and text.lower() in ('true', 'false', '1', '0'):
            return text.lower() in ('true', '1')
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ConfigError(f"{key}={value!r} is not a valid {want.__name__}") from None
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if want is bool and (isinstance(value, bool) or value in (0, 1)):
        return bool(value)
    if want is str and isinstance(value, str):
        return value
    if want is float and numeric:
        try:
            number = float(value)
        except OverflowError:  # an int beyond float's range
            number = math.inf
        if not math.isfinite(number):  # 1e400 reads as inf: torch would fail far later
            raise ConfigError(f"{key}={value!r} is not a finite number; give one such as {default!r}")
        return number
    if want is int and numeric and isinstance(value, int):
        if not -(2**63) <= value < 2**63:  # seeds, sizes: beyond, torch fails in its own words
            raise ConfigError(
                f"{key}={value} does not fit in 64 bits (torch's integers, -2**63 .. 2**63-1); "
                f"give a {key} in that range"
            )
        return value
    raise ConfigError(
        f"{key}={value!r} has type {type(value).__name__}, expected {want.__name__} (default {default!r})"
    )


def load_config_file(path):
    """The public names a config file assigns (not its modules and functions), and {name: "config file 'x', line N"}."""
    try:
        with open(path, encoding='utf-8') as f:
            source = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path!r} is not UTF-8 text; save it as UTF-8 (a Python file)") from None
    namespace = {'__file__': path}  # lets a config file build on another one next to it
    try:
        tree = ast.parse(source, path)
        exec(compile(tree, path, 'exec'), namespace)
    except SystemExit:
        raise ConfigError(f"config file {path!r} calls exit(); a config file only assigns keys") from None
    except Exception as e:  # a mistake inside the file: one line naming the file and line
        if isinstance(e, SyntaxError):
            line, message = e.lineno, e.msg
        else:
            frames = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == path]
            line, message = (frames or ['?'])[-1], (str(e).splitlines() or [''])[0]
        raise ConfigError(f"config file {path!r}, line {line}: {type(e).__name__}: {message}") from None
    stores = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    lines = {n.id: n.lineno for n in sorted(stores, key=lambda n: n.lineno)}  # a name's last assignment wins
    values = {k: v for k, v in namespace.items() if not (k.startswith('_') or callable(v) or inspect.ismodule(v))}
    return values, {k: f"config file {path!r}" + (f", line {lines[k]}" if k in lines else '') for k in values}


# rules: (test, requirement) pairs; the error names the key, the value and the requirement
def at_least(low, requirement=None, measure=lambda v: v):
    return (lambda v: measure(v) >= low), requirement or f">= {low}"


def above(low, upper=None):
    if upper is None:
        return (lambda v: v > low), f"> {low}"
    return (lambda v: low < v <= upper), f"in ({low}, {upper}]"


def between(low, high, closed=False):
    if closed:
        return (lambda v: low <= v <= high), f"in [{low}, {high}]"
    return (lambda v: low <= v < high), f"in [{low}, {high})"


def one_of(*choices, label=None, described=None):
    """label: the error reads "unknown <label> 'x'; choose one of a, b, c"; described: the requirement in words."""
    listed = ' or '.join(map(repr, choices)) if len(choices) < 3 else f"one of {', '.join(map(repr, choices))}"
    requirement = (label, choices) if label else described or listed
    return (lambda v: v in choices), requirement


def check_rule(key, value, rule):
    test, requirement = rule
    if test(value):
        return
    if isinstance(requirement, tuple):  # one_of with a label
        label, choices = requirement
        raise ConfigError(f"unknown {label} {value!r}; choose one of {', '.join(choices)}")
    raise ConfigError(f"{key} must be {requirement}, got {value!r}")


def wants_help(argv):
    return any(arg in ('-h', '--help') for arg in argv)


def help_text(usage, defaults, meanings=None):
    """--help's text: `usage`, then every key, its default and its meaning where `meanings` has one."""
    keys = '\n'.join(f"  {f'--{k}={v!r}':<36} {(meanings or {}).get(k, '')}".rstrip() for k, v in defaults.items())
    return f"{usage.strip()}\n\nkeys (default, meaning):\n{keys}"


def command_line(argv, defaults, rules=None, usage='', meanings=None, given=None):
    """configure(), or --help prints `usage` and the keys and exits 0; a bad argument exits 1 with an `error:` line."""
    if wants_help(argv):
        print(help_text(usage, defaults, meanings))
        sys.exit(0)
    try:
        return configure(defaults, argv, rules, given)
    except ConfigError as e:
        sys.exit(f"error: {e}")


def configure(defaults, argv, rules=None, given=None):
    """`defaults` updated by argv's config files and overrides, each checked by its rule in `rules`. given: a set
    that receives the keys argv sets (a resume tells an override from a default by it)."""
    config = dict(defaults)
    set_in = {}  # key -> where the config file that set it last sets it: its errors name the file and line
    for arg in argv:
        where = {}
        if arg.startswith('--'):
            key, sep, value = arg[2:].partition('=')
            if not sep and isinstance(defaults.get(key), bool):
                value = True  # a bare --key of a boolean key
            elif not sep:
                hint = f"give --{key}=VALUE" if key in defaults else _unknown_key(key, defaults)
                raise ConfigError(f"expected --key=value, got {arg!r}; {hint}")
            updates = {key: value}
        else:
            updates, where = load_config_file(arg)
        for key, value in updates.items():
            try:
                if key not in defaults:
                    raise _unknown_key(key, defaults)
                config[key] = coerce(key, value, defaults[key])
            except ConfigError as e:
                raise ConfigError(f"{where[key]}: {e}") if where else e from None
            set_in[key] = where.get(key)
            if given is not None:
                given.add(key)
    for key, rule in (rules or {}).items():
        try:
            check_rule(key, config[key], rule)
        except ConfigError as e:
            raise ConfigError(f"{set_in[key]}: {e}") if set_in.get(key) else e from None
    return config
