"""The pick policy: which worker serves a call (strategies, kv_aware scoring, load and
breakers per worker). The router's Pick and the gateway's in-process pick run this one
implementation (``picker.Picker``); see docs/control-flow.md."""
