"""What to fetch and from where: `hf:ORG/NAME`, `modelscope:ORG/NAME`, `--from`, `--endpoint` and mirror aliases."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from porting.errors import InputError, MappingTableError

HUBS = ("hf", "modelscope")
FROM_CHOICES = ("hf", "mirror", "modelscope")
DEFAULT_ENDPOINTS = {"hf": "https://huggingface.co", "modelscope": "https://modelscope.cn"}
ENDPOINT_ENV = {"hf": "HF_ENDPOINT", "modelscope": "MODELSCOPE_ENDPOINT"}
# Named endpoints for --endpoint; "hf-mirror" is the common mirror of the Hub for mainland China.
ENDPOINT_ALIASES = {"hf-mirror": "https://hf-mirror.com", "mirror": "https://hf-mirror.com",
                    "hf": "https://huggingface.co", "modelscope": "https://modelscope.cn"}
HF_MIRROR = ENDPOINT_ALIASES["hf-mirror"]
# Tokens go to these hosts only; any other endpoint is a third party unless the user passes --send-token.
OFFICIAL_HOSTS = {"hf": {"huggingface.co", "hf.co"},
                  "modelscope": {"modelscope.cn", "www.modelscope.cn", "modelscope.ai", "www.modelscope.ai"}}
PREFIXES = {"hf": "hf", "huggingface": "hf", "modelscope": "modelscope", "ms": "modelscope"}

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def check_repo_id(repo: str, where: str = "") -> None:
    if not _REPO_ID.fullmatch(repo) or ".." in repo:
        msg = f"{repo!r} is not a repository id of the form ORG/NAME."
        if where:  # inside recipes.toml: a bug in the data, not in the user's input
            raise MappingTableError(f"{where}: {msg}")
        raise InputError(msg, hint="Write it as hf:ORG/NAME or modelscope:ORG/NAME, e.g. "
                                   "hf:black-forest-labs/FLUX.2-klein-4B.")


@dataclass(frozen=True)
class Source:
    """A repository on one hub, reached through one endpoint."""

    hub: str        # "hf" or "modelscope": which client and protocol
    repo: str
    endpoint: str   # without trailing slash

    @property
    def host(self) -> str:
        return urlsplit(self.endpoint).hostname or ""

    @property
    def official(self) -> bool:
        """True for the hub's own https hosts, the only ones a token is sent to by default."""
        return urlsplit(self.endpoint).scheme == "https" and self.host in OFFICIAL_HOSTS[self.hub]

    @property
    def label(self) -> str:
        return f"{self.hub}:{self.repo}"

    @property
    def repo_url(self) -> str:
        """The repository's page, where a gated licence is accepted."""
        if self.hub == "modelscope":
            return f"{self.endpoint}/models/{self.repo}"
        return f"{self.endpoint}/{self.repo}"


def normalize_endpoint(value: str) -> str:
    """An alias (hf-mirror, ...) or an http(s) URL without credentials, returned without trailing '/'."""
    url = ENDPOINT_ALIASES.get(value.strip().lower(), value.strip())
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:  # "http://[::1": an unclosed IPv6 address
        host = None
    if host is None or parts.scheme not in ("http", "https"):
        raise InputError(f"--endpoint {value!r} is neither a known alias nor an http(s) URL.",
                         hint=f"Use a full URL such as https://hf-mirror.com, or one of: "
                              f"{', '.join(sorted(ENDPOINT_ALIASES))}.")
    if parts.username or parts.password:
        raise InputError("--endpoint must not contain credentials.",
                         hint="Put the token in HF_TOKEN (or MODELSCOPE_API_TOKEN), never in a URL.")
    if parts.query or parts.fragment:
        raise InputError(f"--endpoint {value!r} must not have a query or fragment.")
    return url.rstrip("/")


def resolve_endpoint(hub: str, via: str | None, endpoint: str | None) -> str:
    """--endpoint wins; else the mirror for --from mirror; else HF_ENDPOINT / MODELSCOPE_ENDPOINT; else the hub."""
    if endpoint:
        return normalize_endpoint(endpoint)
    if via == "mirror":
        return HF_MIRROR
    env = os.environ.get(ENDPOINT_ENV[hub])
    if env:
        return normalize_endpoint(env)
    return DEFAULT_ENDPOINTS[hub]


def hub_for(via: str | None) -> str:
    return "modelscope" if via == "modelscope" else "hf"


def parse_source(text: str, via: str | None = None, endpoint: str | None = None) -> Source | None:
    """Parse `hf:ORG/NAME`, `modelscope:ORG/NAME` (or `ms:`) or `ORG/NAME`; None when `text` names a recipe.

    `via` is the --from choice (hf, mirror, modelscope); it must agree with an explicit prefix.
    """
    if via is not None and via not in FROM_CHOICES:
        raise InputError(f"--from {via!r} is not one of {', '.join(FROM_CHOICES)}.")
    prefix, sep, rest = text.partition(":")
    if sep and prefix.lower() in PREFIXES:
        hub = PREFIXES[prefix.lower()]
        if via is not None and hub_for(via) != hub:
            raise InputError(f"{text!r} is on {hub} but --from {via} was given.",
                             hint="Drop --from, or write the source with the matching prefix "
                                  "(hf:ORG/NAME for --from hf or mirror, modelscope:ORG/NAME for --from modelscope).")
        repo = rest
    elif sep:
        raise InputError(f"Unknown source prefix {prefix!r} in {text!r}.",
                         hint="Use hf:ORG/NAME or modelscope:ORG/NAME (mirrors: --from mirror or --endpoint URL).")
    elif "/" in text:
        hub, repo = hub_for(via), text
    else:
        return None
    check_repo_id(repo)
    return Source(hub=hub, repo=repo, endpoint=resolve_endpoint(hub, via, endpoint))
