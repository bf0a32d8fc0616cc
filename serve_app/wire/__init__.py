"""What crosses between the router and a model replica, in one room.

- ``messages.py``: the handle call's items as small dataclasses (pickled by Serve): the
  ``Call`` the router makes, and what the replica yields back — an ``Answer`` (a whole body),
  a ``StreamOpen`` or an ``Accepted`` (the byte socket to connect to), and the ``Trailer`` last.
- ``socket.py``: the byte socket's protocol — the replica's listener, the router's connect, the
  ticket, keepalive, and end-of-file as the router's hang-up.
- ``line.py``: the direct line — the same items on a connection the router keeps to the
  replica's listener, without the handle (a model with one replica).
- ``sse.py``: every server-sent event read or written, by router and replica alike.
"""
