"""``tandem http``: the HTTP bridge, OpenAI's, Ollama's and Anthropic's APIs on one
loopback port, a client of the daemon like any other. server.py is the HTTP side
(aiohttp), routes.py picks a dialect by path, exchange.py is one request being
answered, and openai_bridge.py, ollama_api.py and anthropic_api.py translate:
each parses its JSON into translate.py's one typed request (GenRequest) and
renders the daemon's result back; answers.py has their error shapes and
streamed encodings, api_key.py the optional key."""
