"""Where a push goes: the repository id, the hub, its endpoint, and whether a token may be sent there."""

from __future__ import annotations

import os
from dataclasses import dataclass

from porting.errors import AuthError, InputError, holds_secret
from porting.hub.fetch.sources import Source, check_repo_id, normalize_endpoint, resolve_endpoint

PUSH_HUBS = ("hf", "modelscope")
TOKEN_ENV = {"hf": "HF_TOKEN", "modelscope": "MODELSCOPE_API_TOKEN"}
LOGIN = {"hf": "`hf auth login`", "modelscope": "`modelscope login`"}


@dataclass(frozen=True)
class PushTarget:
    source: Source      # hub, repo id and endpoint (the same type port fetch reads from)
    private: bool
    send_token: bool    # the user allowed a token to go to an endpoint that is not the hub's own host
    timeout: float = 120.0  # seconds without an answer (per request / socket operation) before giving up

    @property
    def hub(self) -> str:
        return self.source.hub

    @property
    def repo(self) -> str:
        return self.source.repo


def push_target(repo: str, hub: str = "hf", *, endpoint: str | None = None, public: bool = False,
                send_token: bool = False, timeout: float = 120.0) -> PushTarget:
    """Check the name (exit 2) and that a token may be sent to the endpoint (exit 3), before any work."""
    if hub not in PUSH_HUBS:
        raise InputError(f"--push-to {hub!r}: choose one of {', '.join(PUSH_HUBS)}.")
    check_push_name(repo, hub)
    url = normalize_endpoint(endpoint) if endpoint is not None else resolve_endpoint(hub, None, None)
    source = Source(hub=hub, repo=repo, endpoint=url)
    if not source.official and not send_token:
        raise AuthError(f"{source.host} is not {hub}'s own host: flux-port does not send your {hub} token there "
                        "unless told to, and a push needs one.",
                        hint="Pass --send-token if you trust this endpoint, or unset "
                             f"{'HF_ENDPOINT' if hub == 'hf' else 'MODELSCOPE_ENDPOINT'} / --endpoint.")
    return PushTarget(source=source, private=not public, send_token=send_token, timeout=timeout)


def check_push_name(repo: str, hub: str) -> None:
    """ORG/NAME as the hub takes it, refused here (exit 2) rather than by the hub after the token check: on the
    Hugging Face Hub each part is at most 96 characters, without `--` and not ending in `.git`."""
    hint = "Name the repository with its owner, e.g. --push my-org/my-klein-finetune."
    if holds_secret(repo):  # shown as *** (errors.redact); a name holding a token would publish it: refused
        raise InputError(f"--push {repo!r}: it holds a credential (a repository id is ORG/NAME; nothing was sent).",
                         hint=f"{hint} A token never goes on the command line: set "
                              f"{TOKEN_ENV.get(hub, 'HF_TOKEN')} or run {LOGIN.get(hub, LOGIN['hf'])}.")
    try:
        check_repo_id(repo)
    except InputError:
        raise InputError(f"--push {repo!r} is not a repository id of the form ORG/NAME.", hint=hint) from None
    if hub == "hf":
        why = next((w for w, bad in (("a part is longer than 96 characters", max(map(len, repo.split("/"))) > 96),
                                      ("it holds '--'", "--" in repo), ("it ends in '.git'", repo.endswith(".git")))
                    if bad), None)
        if why:
            raise InputError(f"--push {repo!r}: the Hugging Face Hub takes no such repository name ({why}).", hint=hint)


def no_token(target: PushTarget) -> AuthError:
    hub = target.hub
    return AuthError(f"No {'Hugging Face' if hub == 'hf' else 'ModelScope'} token found: pushing to "
                     f"{target.repo} needs one with write access; nothing was uploaded.",
                     hint=f"Set {TOKEN_ENV[hub]} or run {LOGIN[hub]}, then run the same command again.")


def env_token(hub: str) -> str | None:
    return os.environ.get(TOKEN_ENV[hub]) or None
