"""
nanoGPT's configurator, made strict. Usage from a script with module-level defaults:

    $ python train.py config/shakespeare_lisa_wor.py --batch_size=32 --compile=False

Arguments without '--' are Python config files executed in order; '--key=value' overrides
follow. Unlike nanoGPT's exec-into-globals, every key must already exist as a default
(a typo fails with the closest valid names), values keep the default's type (an int is a
valid float, booleans read True/False/true/false/1/0), and the resolved config is returned
as a plain dict, which train.py also stores in its checkpoints.
"""
import ast
import difflib
import traceback


class ConfigError(ValueError):
    pass


def _unknown_key(key, defaults):
    close = difflib.get_close_matches(key, defaults, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else "; see the defaults at the top of the script"
    return ConfigError(f"unknown config key {key!r}{hint}")


def coerce(key, value, default):
    """Return `value` converted to the type of `default` (a bool, int, float or str: callers keep
    only such defaults), or raise a one-line ConfigError."""
    want = type(default)
    if isinstance(value, str) and want is not str:
        text = value.strip()
        if want is bool and text.lower() in ('true', 'false', '1', '0'):
            return text.lower() in ('true', '1')
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise ConfigError(f"{key}={value!r} is not a valid {want.__name__}") from None
    if want is bool:
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
    elif want is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif want is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif want is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key}={value!r} has type {type(value).__name__}, expected {want.__name__} "
                      f"(default {default!r})")


def load_config_file(path):
    """The public names a config file assigns (modules and functions it uses are skipped)."""
    try:
        with open(path) as f:
            source = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
    namespace = {'__file__': path}  # lets a config file build on another one next to it
    try:
        exec(compile(source, path, 'exec'), namespace)
    except Exception as e:
        # a mistake inside the file (SyntaxError, NameError, ...): one line naming the file and line
        line = e.lineno if isinstance(e, SyntaxError) else \
            next((f.lineno for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == path), '?')
        message = e.msg if isinstance(e, SyntaxError) else (str(e).splitlines() or [''])[0]
        raise ConfigError(f"config file {path!r}, line {line}: {type(e).__name__}: {message}") from None
    return {k: v for k, v in namespace.items()
            if not k.startswith('_') and not callable(v) and type(v).__name__ != 'module'}


def configure(defaults, argv):
    """Apply config files and --key=value overrides in argv to `defaults`; return the result."""
    config = dict(defaults)
    for arg in argv:
        if arg.startswith('--'):
            key, sep, value = arg[2:].partition('=')
            if not sep:
                raise ConfigError(f"expected --key=value, got {arg!r}")
            updates = {key: value}
        else:
            updates = load_config_file(arg)
        for key, value in updates.items():
            if key not in defaults:
                raise _unknown_key(key, defaults)
            config[key] = coerce(key, value, defaults[key])
    return config


def format_config(config):
    return '\n'.join(f'  {k} = {v!r}' for k, v in config.items())
