"""How ranks talk: channels per stage edge, the data plane, receive rings, agreement
inside a tensor- or expert-parallel group, and the boards every rank reads in the store."""
