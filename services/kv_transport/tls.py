"""TLS for the KV transport (optional), always mutual: every worker has a certificate signed by the
mesh's own CA and accepts only peers with one. Host names are not checked (workers advertise
addresses that change, such as pod IPs): the CA, which should sign this mesh's workers alone, is
what identifies a peer."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    """This worker's certificate (PEM), signed by `ca`."""
    key: Path
    """Its private key (PEM)."""
    ca: Path
    """The CA certificate(s) (PEM) a peer's certificate must chain to."""

    @classmethod
    def from_flags(cls, cert: Path | None, key: Path | None, ca: Path | None) -> TlsFiles | None:
        """All three files or none (no TLS); a clear error for a missing or unusable one."""
        given = {"--kv-tls-cert": cert, "--kv-tls-key": key, "--kv-tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [flag for flag, path in given.items() if path is None]
        if missing:
            raise ValueError(
                f"KV TLS needs --kv-tls-cert, --kv-tls-key and --kv-tls-ca; missing {', '.join(missing)}"
            )
        assert cert is not None and key is not None and ca is not None
        files = cls(cert, key, ca)
        files.server_context()  # unreadable or mismatched files fail here, at start-up
        return files

    def server_context(self) -> ssl.SSLContext:
        context = self._context(ssl.Purpose.CLIENT_AUTH)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        context = self._context(ssl.Purpose.SERVER_AUTH)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(purpose, cafile=str(self.ca))
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"KV TLS files {self.cert}, {self.key}, {self.ca}: {exc}") from None
        return context
