"""The internal CA (spec: Security, internal service authentication):
``InitCertificateAuthority``.

The API makes the key and certificate (key generation needs randomness, which apply
may not use) and proposes them; here they are checked and kept. Every member then holds
the CA, so any of them can sign a node agent's certificate request, and a new leader
needs nothing handed over. A rotation keeps the old CA certificate trusted
(``ca_previous``): agents renew onto the new CA within two thirds of their lifetime
and nothing they hold stops working on the day of the rotation.
"""

from __future__ import annotations

from cryptography import x509
from lattice_common import commands as c
from lattice_common import pki
from lattice_common.errors import AlreadyExists, ValidationError

from lattice_quorum.global_state import Changes, GlobalState

#: CAs rotated out that stay trusted; older ones are dropped (what they signed has
#: expired long before a third rotation in practice: agent certificates live 3 days)
MAX_PREVIOUS = 4


def init_certificate_authority(
    state: GlobalState, cmd: c.InitCertificateAuthority, ch: Changes
) -> c.CommandResult:
    if state.ca_cert_pem and not cmd.rotate:
        raise AlreadyExists(
            f"the cluster already has a CA (serial {pki.serial_of(state.ca_cert_pem.encode())})",
            hint="Rotate it with `lattice admin ca init --rotate`; certificates it signed "
            "stay trusted until they expire.",
        )
    try:
        cert = pki.load_cert(cmd.cert_pem.encode())
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except (pki.CertError, x509.ExtensionNotFound) as e:
        raise ValidationError(f"not a CA certificate: {e}") from None
    if not constraints.ca:
        raise ValidationError("not a CA certificate: basicConstraints CA is false")
    if "PRIVATE KEY" not in cmd.key_pem:
        raise ValidationError("the CA key must be a PEM private key")
    state.revision += 1  # common.bump; common imports the audit module this one mirrors
    if state.ca_cert_pem:
        state.ca_previous = [state.ca_cert_pem, *state.ca_previous][:MAX_PREVIOUS]
    state.ca_cert_pem = cmd.cert_pem
    state.ca_key_pem = cmd.key_pem
    return c.CommandResult(revision=state.revision)


__all__ = ["init_certificate_authority"]
