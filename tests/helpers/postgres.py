"""A throwaway PostgreSQL server for one test module: ``initdb`` + ``pg_ctl`` in a temporary folder, on a free
local port, stopped and deleted afterwards.

Why the system's own server binaries (Debian's ``postgresql`` package, which ``.ci/run`` installs) rather than an
embedded-server wheel: they are the server a shared study really talks to, they come from the distribution with its
security updates, and they cost no extra download in a virtual environment. PostgreSQL refuses to run as root; as
root, the server runs as the ``postgres`` user that the package creates.

:func:`unavailable` says why no server can be started here (no server binaries, no driver, no user to run it as),
so the tests skip with that reason instead of failing.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

#: The database a shared study uses in the tests (the docs' ``.../studies``).
DATABASE = "studies"
USER = "studies"


def server_binaries() -> Path | None:
    """The folder with ``initdb`` and ``pg_ctl``: on PATH, else Debian's newest ``/usr/lib/postgresql/<v>/bin``."""
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl", path=str(Path(found).resolve().parent)):
        return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(versions[-1]).parent if versions else None


def server_user() -> str | None:
    """Who runs the server: ourselves, or as root (which PostgreSQL refuses) the ``postgres`` user."""
    if os.geteuid() != 0:
        return pwd.getpwuid(os.geteuid()).pw_name
    try:
        return pwd.getpwnam("postgres").pw_name
    except KeyError:
        return None


def unavailable() -> str | None:
    """Why no throwaway server can run here, or None when one can."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "no PostgreSQL driver: pip install -e '.[postgres]' (psycopg)"
    if server_binaries() is None:
        return "no PostgreSQL server binaries (initdb, pg_ctl): apt-get install postgresql"
    if server_user() is None:
        return "running as root and there is no `postgres` user to run the server as"
    return None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def throwaway_server() -> Iterator[str]:
    """Start a server, create the database ``studies``, yield its SQLAlchemy URL; stop and delete it at the end."""
    import psycopg

    binaries, user = server_binaries(), server_user()
    assert binaries is not None and user is not None, unavailable()
    # not under pytest's tmp_path: that folder is root's own (mode 0700), where the postgres user cannot go
    folder = Path(tempfile.mkdtemp(prefix="putm-postgres-"))
    owner = pwd.getpwnam(user)
    os.chown(folder, owner.pw_uid, owner.pw_gid)
    data, log = folder / "data", folder / "server.log"
    as_user = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []} if os.geteuid() == 0 else {}
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}

    def pg(*args: str, timeout: float = 60) -> None:
        done = subprocess.run([str(binaries / args[0]), *args[1:]], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=timeout, **as_user)
        if done.returncode != 0:
            server_log = log.read_text() if log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed:\n{done.stdout}{done.stderr}{server_log}")

    started = False
    try:
        pg("initdb", "-D", str(data), "-U", USER, "--auth=trust", "--no-sync", "--encoding=UTF8")
        for attempt in range(3):  # the free port may be taken between the probe and the start: try another
            port = free_port()
            options = (f"-c listen_addresses=127.0.0.1 -p {port} -k {folder} -c fsync=off "
                       "-c synchronous_commit=off -c full_page_writes=off")
            try:
                pg("pg_ctl", "-D", str(data), "-l", str(log), "-o", options, "-w", "-t", "60", "start", timeout=90)
                started = True
                break
            except RuntimeError:
                if attempt == 2:
                    raise
        with psycopg.connect(host="127.0.0.1", port=port, user=USER, dbname="postgres", autocommit=True) as db:
            db.execute(f"CREATE DATABASE {DATABASE}")
        yield f"postgresql://{USER}@127.0.0.1:{port}/{DATABASE}"
    finally:
        if started:
            with contextlib.suppress(Exception):
                pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)


def fresh_database(url: str, name: str) -> str:
    """A new, empty database on the server of ``url``; its URL."""
    import psycopg

    base = url.rsplit("/", 1)[0]
    with psycopg.connect(f"{base}/postgres", autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    return f"{base}/{name}"
