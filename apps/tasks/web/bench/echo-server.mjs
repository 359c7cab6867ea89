// The naive floor of the `web` suite: a plain `ws` server in Node that answers each JSON
// request `{id, method, args}` with `{id, result}`, the result a fixed task as JSON. Prints
// `{"listening": PORT}` once it listens.
import { WebSocketServer } from "ws";

const result = JSON.parse(process.argv[2] ?? "null");
const wss = new WebSocketServer({ host: "127.0.0.1", port: 0 });
wss.on("connection", (ws) => {
  ws.on("message", (data) => {
    const req = JSON.parse(data.toString());
    ws.send(JSON.stringify({ id: req.id, result }));
  });
});
wss.on("listening", () => console.log(JSON.stringify({ listening: wss.address().port })));
