"""``dipaco admin``: staff users, admin API tokens and enrollment tokens, from the shell.

Works on the database the server's settings point at (DATABASE_URL, or the
embedded SQLite in DIPACO_DATA_DIR, or --data-dir), so run it where the server runs,
with the same environment. A data dir without a database is refused before anything is
opened: SQLite would otherwise leave an empty db.sqlite3 (and Django a secret key and
broker folders) in a directory the user never meant. Django is imported only when the
command runs, and its log lines are shown only with --verbose.

Secrets (passwords, tokens) are printed once, alone on stdout, so a script can
capture them; everything else goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from dipaco.cli.command import Command

DESCRIPTION = """\
Manage who may use this dipaco server:
  createuser NAME        a user (add --staff for the admin API)
  token create USER      an admin API token for a staff user (shown once)
  token revoke ID        refuse a token from now on
  enroll                 an enrollment token volunteers register workers with"""

EPILOG = """\
The database is the one `dipaco server` uses with the same environment: DATABASE_URL,
else db.sqlite3 in the data dir (DIPACO_DATA_DIR or --data-dir; default
~/.local/share/dipaco). `dipaco demo` keeps its own, ~/.local/share/dipaco/demo.

examples:
  dipaco admin createuser alice --staff
  dipaco admin --data-dir ~/.local/share/dipaco/demo createuser alice --staff
  TOKEN=$(dipaco admin token create alice --name laptop)
  curl -H "Authorization: Bearer $TOKEN" http://127.0.0.1:8000/api/v1/runs
  dipaco admin enroll --uses 10 --expires 7d"""

_DURATION = re.compile(r"^(\d+)([smhdw])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class AdminError(Exception):
    """A refusal to print as ``dipaco admin: <message>`` with exit status 1."""


def parse_duration(text: str) -> timedelta | None:
    """'90s', '30m', '12h', '7d', '2w' as a timedelta; 'never' as None."""
    if text == "never":
        return None
    match = _DURATION.match(text.strip().lower())
    if match is None or int(match.group(1)) == 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; use e.g. 30m, 12h, 7d or never"
        )
    return timedelta(seconds=int(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def parse_uses(text: str) -> int | None:
    """A positive count, or 'unlimited' (None)."""
    if text == "unlimited":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use a count of at least 1, or unlimited")
    return int(text)


def add_commands(parser: argparse.ArgumentParser) -> None:
    """The admin subcommands, on `parser` (``dipaco admin`` or a standalone parser)."""
    add_common_options(parser)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    def add_command(
        where: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str
    ) -> argparse.ArgumentParser:
        command = where.add_parser(name, help=help)
        add_common_options(command)
        return command

    user = add_command(commands, "createuser", "create a user; prints its password")
    user.add_argument("name", help="the user name")
    user.add_argument("--email", default="", help="the user's email address")
    user.add_argument("--staff", action="store_true", help="may use the admin API")
    user.add_argument(
        "--password-stdin",
        action="store_true",
        help="read the password from stdin instead of generating one",
    )
    user.set_defaults(handler=createuser)

    token = commands.add_parser("token", help="create or revoke admin API tokens")
    token_commands = token.add_subparsers(title="commands", metavar="COMMAND", required=True)
    create = add_command(token_commands, "create", "a new token for USER; printed once")
    create.add_argument("user", help="a staff user's name")
    create.add_argument("--name", default="", help="what the token is for, e.g. laptop")
    create.set_defaults(handler=token_create)
    revoke = add_command(token_commands, "revoke", "refuse a token from now on")
    revoke.add_argument("id", type=int, help="the token's id (printed when it was created)")
    revoke.set_defaults(handler=token_revoke)

    enroll_parser = add_command(commands, "enroll", "an enrollment token for volunteers")
    enroll_parser.add_argument(
        "--uses",
        type=parse_uses,
        default=1,
        metavar="N",
        help="workers it may register, or 'unlimited' (default: 1)",
    )
    enroll_parser.add_argument(
        "--expires",
        type=parse_duration,
        default=parse_duration("7d"),
        metavar="DURATION",
        help="e.g. 30m, 12h, 7d, 2w or never (default: 7d)",
    )
    enroll_parser.add_argument("--label", default="", help="who or what it is for")
    enroll_parser.add_argument(
        "--trusted",
        action="store_true",
        help="for your own machines: its workers skip probation and referee first rounds",
    )
    enroll_parser.set_defaults(handler=enroll)


def add_common_options(parser: argparse.ArgumentParser) -> None:
    """--data-dir and --verbose, before or after the command (`dipaco admin --data-dir D
    enroll` or `dipaco admin enroll --data-dir D`): SUPPRESS leaves the attribute unset
    where not given, so a command's parser keeps what the outer one read."""
    parser.add_argument(
        "--data-dir",
        type=Path,
        metavar="DIR",
        default=argparse.SUPPRESS,
        help="the server's data dir (default: DIPACO_DATA_DIR, else ~/.local/share/dipaco)",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="also show the server's log lines",
    )


def setup_django() -> None:
    """Configure Django from the environment (once); a no-op inside a running server or test."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")
    try:
        # Django only when a command runs: the dispatcher lists it without the server installed
        import django
        from django.apps import apps
    except ModuleNotFoundError:
        raise AdminError(
            "Django is not installed; install the server extra: pip install 'dipaco[server]'"
        ) from None
    if not apps.ready:
        django.setup()


SQLITE_ENGINE = "django.db.backends.sqlite3"


def check_database_exists(environ: Mapping[str, str], given_by: str = "DIPACO_DATA_DIR") -> None:
    """Refuse, before Django opens it, an SQLite database file that does not exist.

    Says where it looked and how to point the command elsewhere; creates nothing.
    PostgreSQL (DATABASE_URL) is left to the connection, which names its own problem.
    """
    # Django only when a command runs (the module docstring)
    from django.core.exceptions import ImproperlyConfigured

    from dipaco_server import env  # needs Django, which this module imports without

    try:
        data = env.data_dir_path(environ)
        database = env.database(environ, data)
    except ImproperlyConfigured as exc:
        raise AdminError(str(exc)) from None
    path = Path(database["NAME"])
    if database["ENGINE"] != SQLITE_ENGINE or path.exists():
        return
    if environ.get("DATABASE_URL", "").strip():
        raise AdminError(
            f"no database at {path} (from DATABASE_URL); nothing was created. Set DATABASE_URL "
            "to the database `dipaco server` uses"
        )
    where = given_by if environ.get("DIPACO_DATA_DIR", "").strip() else "the default"
    default = {k: v for k, v in environ.items() if k != "DIPACO_DATA_DIR"}
    demo = env.data_dir_path(default) / "demo"  # dipaco_demo.cli.default_data_dir
    found = sorted(p.parent for p in data.glob("*/db.sqlite3")) if data.is_dir() else []
    if (demo / path.name).exists():
        found.insert(0, demo)
    lines = [
        f"no database in the data dir {data} ({where}); nothing was created.",
        "  Point the command at the data dir `dipaco server` runs with: --data-dir DIR or",
        "  DIPACO_DATA_DIR=DIR (or DATABASE_URL for PostgreSQL).",
        f"  `dipaco demo` keeps its own data dir, {demo} by default.",
    ]
    if found and found[0] != data:
        lines.append(f"  A data dir with a database: {found[0]}; e.g.")
        lines.append(f"    dipaco admin --data-dir {found[0]} createuser alice --staff")
    raise AdminError("\n".join(lines))


def check_database_migrated() -> None:
    """A database without the server's tables (never served from) gets the command to fix it."""
    # Django only when a command runs (the module docstring)
    from django.db import connection

    if "auth_user" not in connection.introspection.table_names():
        name = connection.settings_dict["NAME"]
        raise AdminError(
            f"the database {name} has no tables yet; start `dipaco server` once with the same "
            "environment (it applies the migrations), or run: django-admin migrate"
        )


@contextlib.contextmanager
def server_logs(verbose: bool) -> Iterator[None]:
    """The server's INFO lines (created user ...) only when asked: the command says it itself."""
    loggers = [logging.getLogger(name) for name in ("dipaco_server", "dipaco_web")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.INFO if verbose else logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def createuser(args: argparse.Namespace) -> int:
    # Models load once run() has set Django up; this module imports without Django.
    from dipaco_server.accounts.services import create_user

    password = None
    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
        if len(password) < 8:
            raise AdminError("the password read from stdin is shorter than 8 characters")
    user, password_used = create_user(
        args.name, email=args.email, staff=args.staff, password=password
    )
    _say(f"created user {user.username!r} (id {user.pk}{', staff' if args.staff else ''})")
    if not args.password_stdin:
        _say("its password (shown once):")
        print(password_used, flush=True)
    return 0


def token_create(args: argparse.Namespace) -> int:
    # Models load once run() has set Django up; this module imports without Django.
    from dipaco_server.accounts.services import create_api_token, find_user

    user = find_user(args.user)
    if not user.is_staff:
        _say(f"warning: {user.username!r} is not staff; the admin API refuses its tokens")
    row, plaintext = create_api_token(user, name=args.name)
    _say(f"created API token {row.pk} for {user.username!r}; it is shown once:")
    print(plaintext, flush=True)
    return 0


def token_revoke(args: argparse.Namespace) -> int:
    # Models load once run() has set Django up; this module imports without Django.
    from dipaco_server.accounts.services import revoke_api_token

    row = revoke_api_token(args.id)
    _say(f"revoked API token {row.pk} of {row.user}")
    return 0


def enroll(args: argparse.Namespace) -> int:
    # Models load once run() has set Django up; this module imports without Django.
    from dipaco_server.workers.services import create_enrollment_token

    row, plaintext = create_enrollment_token(
        label=args.label, max_uses=args.uses, expires_in=args.expires, trusted=args.trusted
    )
    uses = "unlimited uses" if row.max_uses is None else f"{row.max_uses} use(s)"
    until = f"until {row.expires_at:%Y-%m-%d %H:%M} UTC" if row.expires_at else "never expires"
    trusted = ", trusted (no probation)" if row.trusted else ""
    _say(f"enrollment token {row.pk}: {uses}, {until}{trusted}; it is shown once:")
    print(plaintext, flush=True)
    return 0


def _django_ready() -> bool:
    """Inside a running server, a test or the demo, Django already has its database."""
    try:
        # ModuleNotFoundError on a worker-only install: then Django is not ready
        from django.apps import apps
    except ModuleNotFoundError:
        return False
    return bool(apps.ready)


def run(args: argparse.Namespace) -> int:
    """Run the chosen command; refusals print their reason and exit 1."""
    try:
        data_dir = getattr(args, "data_dir", None)
        if data_dir is not None:
            os.environ["DIPACO_DATA_DIR"] = str(data_dir.expanduser().resolve())
        if not _django_ready():
            given_by = "DIPACO_DATA_DIR" if data_dir is None else "--data-dir"
            # Without Django, setup_django below says how to install it.
            with contextlib.suppress(ModuleNotFoundError):
                check_database_exists(os.environ, given_by)
        setup_django()
        # after setup_django: Django only when a command runs
        from django.db import DatabaseError

        from dipaco_server.errors import ServiceError  # needs Django, set up just above

        try:
            with server_logs(getattr(args, "verbose", False)):
                check_database_migrated()
                code: Any = args.handler(args)
        except ServiceError as exc:
            raise AdminError(exc.message) from None
        except DatabaseError as exc:
            raise AdminError(
                f"the database refused ({str(exc).strip()}); check DATABASE_URL and apply "
                "migrations (dipaco server does), then retry"
            ) from None
        except ValueError as exc:
            raise AdminError(str(exc)) from None
    except AdminError as exc:
        _say(f"dipaco admin: {exc}")
        return 1
    return int(code or 0)


COMMAND = Command(
    "admin",
    "manage users, admin API tokens and enrollment tokens",
    DESCRIPTION,
    add_commands,
    run,
    epilog=EPILOG,
)
register = COMMAND.register
# python -m dipaco_server.cli.admin ...: the same commands without the `dipaco` wrapper
main = COMMAND.main


if __name__ == "__main__":
    sys.exit(main())
