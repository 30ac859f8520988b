"""Where the remote server is and how kv-offload logs in: URL checks, redaction, password.

Pure, except ``read_password``, which reads the environment or one file when the tier
is built. A password can stay out of the config (invariant 9: vLLM prints
``kv_connector_extra_config`` at start-up, and ``vllm serve``'s command line is visible
to every user of the host): ``remote_password_env`` names an environment variable,
``remote_password_file`` a file. Every message here that shows a URL shows it through
``redact``, and no message shows a password or what was given in place of one.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from typing import Any
from urllib.parse import SplitResult, parse_qs, urlsplit

SCHEMES = ("redis://", "rediss://", "unix://", "valkey://", "valkeys://")
PASSWORD_MAX_BYTES = 4096
EXAMPLE_URL = "'redis://10.0.0.5:6379/0'"
_NODE_RE = re.compile(r"^((redis|rediss|valkey|valkeys)://([^@/]*@)?)?[A-Za-z0-9_.\[\]:-]+:\d+/?$")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_QUERY_PASSWORD_RE = re.compile(r"([?&]password=)[^&#]*")


def redact(url: str) -> str:
    """``url`` with its user info (``user:password@``) and any ``password=`` query value
    replaced by ``***``. Splits on the last ``@`` without parsing the URL, so any string,
    however malformed, comes out without its password."""
    head, sep, rest = url.partition("://")
    if not sep:
        head, rest = "", url
    at = rest.rfind("@")
    if at >= 0:
        rest = "***" + rest[at:]
    return _QUERY_PASSWORD_RE.sub(r"\1***", head + sep + rest)


def has_password(url: str) -> bool:
    """Whether ``url`` carries a password: in its user info or a ``password=`` query."""
    return ":" in _user_info(url) or _QUERY_PASSWORD_RE.search(url) is not None


def has_user_only(url: str) -> bool:
    """Whether ``url`` names a user but no password (``redis://user@host``): redis-py
    cannot log in with a user name alone."""
    return bool(_user_info(url)) and not has_password(url)


def _user_info(url: str) -> str:
    rest = url.partition("://")[2] if "://" in url else url
    return rest.rpartition("@")[0]


def check_server_url(url: Any) -> None:
    """ValueError naming ``remote_url`` unless redis-py would connect to ``url`` as it
    reads: a known scheme, no whitespace, a host and a port 1-65535 (the port may be left
    out), a database that is a number; a unix socket URL has a path and no host."""
    if not isinstance(url, str) or not url.startswith(SCHEMES):
        shown = redact(url) if isinstance(url, str) else url
        raise ValueError(f"remote_url: expected a URL starting with one of {', '.join(SCHEMES)} "
                         f"(e.g. {EXAMPLE_URL}), got {shown!r}")
    shown = redact(url)
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError(f"remote_url: {shown!r} holds a space, a line break or another "
                         f"control character (pasted with the URL?); remove it")
    parts = urlsplit(url)
    if url.startswith("unix://"):
        unix_example = "e.g. 'unix:///run/redis/redis.sock'"
        if parts.hostname:
            raise ValueError(f"remote_url: {shown!r} names a host, not a socket path; a unix "
                             f"socket URL has three slashes before the path, {unix_example}")
        if not parts.path.strip("/"):
            raise ValueError(f"remote_url: {shown!r} names no socket path; write the socket's "
                             f"absolute path after 'unix://', {unix_example}")
    else:
        _check_port(parts, url, "remote_url", EXAMPLE_URL)
        if not parts.hostname:
            raise ValueError(f"remote_url: {shown!r} names no host (an unset shell variable "
                             f"in the URL?); write e.g. {EXAMPLE_URL}")
        if not re.fullmatch(r"/?(\d+/?)?", parts.path):
            raise ValueError(f"remote_url: the database in {shown!r} is not a number; write "
                             f"the database number after the port, e.g. {EXAMPLE_URL}, or "
                             f"leave it out for database 0{_encoding_hint(url)}")
    for db in parse_qs(parts.query).get("db", []):
        if not db.isdigit():
            raise ValueError(f"remote_url: the database (db=) in {shown!r} is not a number; "
                             f"write a database number, e.g. "
                             f"'unix:///run/redis/redis.sock?db=0'")


def check_cluster_node(node: Any) -> str:
    """The seed node ``node`` stripped; ValueError naming ``remote_cluster_nodes`` unless
    it is "host:port" or a URL with a host and a port 1-65535."""
    shown = redact(node) if isinstance(node, str) else node
    if not isinstance(node, str) or not _NODE_RE.match(node.strip()):
        raise ValueError(f"remote_cluster_nodes: expected seed nodes like '10.0.0.5:7000' or "
                         f"'redis://10.0.0.5:7000', got {shown!r}")
    node = node.strip()
    _check_port(urlsplit(node if "://" in node else f"redis://{node}"), node,
                "remote_cluster_nodes", "'10.0.0.5:7000'")
    return node


def _check_port(parts: SplitResult, url: str, field: str, example: str) -> None:
    try:
        port = parts.port
    except ValueError:  # not a number, or out of range
        port = 0
    if port == 0:
        raise ValueError(f"{field}: the port in {redact(url)!r} is not a number from 1 to "
                         f"65535; write e.g. {example}{_encoding_hint(url)}")


def _encoding_hint(url: str) -> str:
    """Why a URL with a password may split where the user did not mean it to."""
    if "@" not in url:
        return ""
    return (" (a password that holds '/', '?', '#' or '@' splits the URL there: "
            "percent-encode it (%2F, %3F, %23, %40), or move it to remote_password_env)")


def check_env_name(name: Any) -> None:
    """ValueError naming ``remote_password_env`` unless ``name`` can name an environment
    variable. The value is never shown: it may be the password itself."""
    if not isinstance(name, str) or not _ENV_NAME_RE.fullmatch(name):
        raise ValueError("remote_password_env: expected the name of an environment variable "
                         "(letters, digits and '_', e.g. KV_OFFLOAD_REDIS_PASSWORD) that holds "
                         "the password, not the password itself")


def check_password_file(path: Any) -> str:
    """``path`` with ``~`` expanded; ValueError naming ``remote_password_file`` unless it is
    an absolute path. The value is never shown: it may be the password itself."""
    expanded = os.path.expanduser(path) if isinstance(path, str) else ""
    if not os.path.isabs(expanded):
        raise ValueError("remote_password_file: expected the absolute path of a file that "
                         "holds the password (e.g. /run/secrets/redis-password)")
    return expanded


def read_password(*, env_name: str | None, file_path: str | None,
                  environ: Mapping[str, str] = os.environ) -> str | None:
    """The password from the environment variable ``env_name`` or the file ``file_path``
    (None when neither is given), read now; one trailing line break is not part of it.
    ValueError names the option and the fix and never holds the password."""
    if env_name is not None:
        value = environ.get(env_name)
        if value is None:
            raise ValueError(
                f"remote_password_env: the environment variable {env_name} is not set in this "
                f"process; export {env_name} where vLLM starts (its engine processes inherit "
                f"it), or name a file with remote_password_file instead")
        return _one_line(value, f"remote_password_env: the environment variable {env_name}")
    if file_path is None:
        return None
    where = f"remote_password_file: {file_path}"
    try:
        if not stat.S_ISREG(os.stat(file_path).st_mode):  # follows links (mounted secrets)
            raise ValueError(f"{where} is not a regular file; point remote_password_file at "
                             f"the file that holds the password")
        with open(file_path, "rb") as f:
            data = f.read(PASSWORD_MAX_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"remote_password_file: cannot read {file_path}: {exc.strerror}; "
                         f"fix the path or the file's permissions for the user vLLM runs "
                         f"as") from None
    if len(data) > PASSWORD_MAX_BYTES:
        raise ValueError(f"{where} is larger than {PASSWORD_MAX_BYTES} bytes: it is not a "
                         f"password file; point remote_password_file at the right file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where} is not UTF-8 text; write the password alone on one "
                         f"line") from None
    return _one_line(text, where)


def _one_line(value: str, where: str) -> str:
    value = value.removesuffix("\n").removesuffix("\r")
    if not value:
        raise ValueError(f"{where} is empty; it must hold the Redis password")
    if "\n" in value or "\r" in value:
        raise ValueError(f"{where} holds more than one line; write the password alone on "
                         f"one line")
    return value
