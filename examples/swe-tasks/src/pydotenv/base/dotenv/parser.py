class DotenvError(ValueError):
    """A malformed line; `line` is its 1-based number."""

    def __init__(self, message, line):
        super().__init__(f"line {line}: {message}")
        self.line = line


def _unquote(value):
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def parse(text):
    """Parses the text of a .env file into a dict (see README.md for the format)."""
    env = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):].lstrip()
        if "=" not in line:
            raise DotenvError(f"expected KEY=VALUE, got {raw!r}", number)
        key, value = line.split("=")[:2]
        env[key.strip()] = _unquote(value.strip())
    return env


def load(path):
    with open(path, encoding="utf-8") as f:
        return parse(f.read())
