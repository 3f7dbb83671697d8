// Function node "On Stop" (synchronous: Node-RED doesn't await it).
const st = context.get("st");
if (st) {
    clearInterval(st.timer);
    node.log(`written=${st.written} failed=${st.failed}`);
    st.client.shutdown().catch(() => {});
}
