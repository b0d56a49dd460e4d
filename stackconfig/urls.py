"""An upstream's base URL: what is accepted, and the reasons a copied link is refused."""

from __future__ import annotations

from urllib.parse import urlsplit

from stackconfig.model import ConfigError

_MODEL_LIST_HOSTS = ("platform.", "console.", "dashboard.", "www.")


def normalize_base_url(raw: str, *, where: str = "base_url") -> str:
    """The API base URL (a bare host gets `/v1`), or ConfigError explaining what is wrong."""
    url = raw.strip().rstrip("/")
    parts = urlsplit(url)
    example = "e.g. http://127.0.0.1:8000/v1 or https://api.example.com/v1"
    if parts.username or parts.password:
        raise ConfigError(
            f"{where} has credentials in the URL: put the key in an environment variable "
            "and name it in `api_key: ${VAR}` instead"
        )
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise ConfigError(f"{where}={raw!r} is not an http(s) URL ({example})")
    if parts.query or parts.fragment:
        raise ConfigError(
            f"{where}={raw!r} has a query string or fragment: this looks like a link copied "
            "from a web page (a marketing or sign-up link), not an API address. Use the "
            f"provider's API base URL from its documentation ({example})"
        )
    if parts.netloc.startswith(_MODEL_LIST_HOSTS) or url.endswith((".html", ".htm")):
        raise ConfigError(
            f"{where}={raw!r} looks like a website address, not an API address. Use the "
            f"OpenAI-compatible API base URL from the provider's documentation ({example})"
        )
    if url.endswith("/v1/v1"):
        raise ConfigError(f"{where}={raw!r} ends in /v1/v1: drop one /v1")
    if url.endswith(("/chat/completions", "/completions", "/generate")):
        raise ConfigError(
            f"{where}={raw!r} names an endpoint: give the base URL instead (drop the "
            f"endpoint path; {example})"
        )
    # A bare host gets the usual /v1; a base with its own path (…/v1, …/api/paas/v4,
    # …/v1beta/openai) is the provider's and is kept as given.
    return url + "/v1" if parts.path in {"", "/"} else url
