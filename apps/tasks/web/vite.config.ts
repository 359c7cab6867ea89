import react from "@vitejs/plugin-react";
import { defineConfig } from "vite";

// `npm run dev` serves the page with hot reload and forwards the API and the RPC WebSocket
// to a `tasks serve` on :8080; `npm run build` writes dist/, which `tasks serve` serves.
export default defineConfig({
  plugins: [react()],
  build: { outDir: "dist", emptyOutDir: true, sourcemap: true },
  server: {
    proxy: {
      "/api": "http://127.0.0.1:8080",
      "/rpc": { target: "ws://127.0.0.1:8080", ws: true },
    },
  },
});
