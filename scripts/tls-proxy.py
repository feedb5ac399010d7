"""A TLS listener in front of a plain one: the test suite's HTTPS endpoint for SQS (moto serves
plain HTTP only on the address the other tests use, and one moto keeps one set of queues).

Usage: tls-proxy.py LISTEN_HOST:PORT TARGET_HOST:PORT CERT KEY

Accepts TLS connections on LISTEN with CERT and KEY (PEM) and copies bytes both ways between each
and a new plain connection to TARGET, until either side closes.
"""
import asyncio
import ssl
import sys


async def pipe(reader, writer):
    """Copies until EOF; then half-closes where the transport can (plain TCP), else closes."""
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
            return
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
        pass
    try:
        writer.close()
    except Exception:  # noqa: BLE001 (closing a broken stream)
        pass


async def main():
    listen, target, cert, key = sys.argv[1:5]
    lhost, lport = listen.rsplit(":", 1)
    thost, tport = target.rsplit(":", 1)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)

    async def handle(client_reader, client_writer):
        try:
            server_reader, server_writer = await asyncio.open_connection(thost, int(tport))
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            pipe(client_reader, server_writer), pipe(server_reader, client_writer)
        )
        for w in (server_writer, client_writer):
            try:
                w.close()
            except Exception:  # noqa: BLE001 (closing a broken stream)
                pass

    server = await asyncio.start_server(handle, lhost, int(lport), ssl=context)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
