"""HTTP plumbing of an event stream: the connection (a uvicorn protocol, subclassed), its
request cycle, the exchange an event stream writes through, compression. The bytes it carries
are made in `formats/`."""
